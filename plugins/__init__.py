"""Built-in mlxr plugins."""
