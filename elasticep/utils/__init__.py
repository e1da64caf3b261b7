"""Small process and logging helpers shared by every layer (imports nothing else)."""
