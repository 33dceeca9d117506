"""The MLX-owning engine: one thread, a request queue, the generation loop."""
