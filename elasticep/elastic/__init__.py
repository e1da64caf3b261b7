"""elastic layer."""
