"""HTTP API plugins."""
