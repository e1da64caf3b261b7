"""entrypoints layer."""
