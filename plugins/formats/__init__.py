"""Format plugins: checkpoint files to a neutral Checkpoint."""
