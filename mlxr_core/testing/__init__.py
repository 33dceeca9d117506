"""Test helpers for mlxr and third-party plugins."""
