"""dloco: Decoupled DiLoCo (placeholder; public surface defined below)."""
