"""Server configuration: schema, strict loading, layering (defaults < file < env < flags)."""
