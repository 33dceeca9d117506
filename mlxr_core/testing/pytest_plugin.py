"""pytest fixtures for mlxr and its plugins."""
