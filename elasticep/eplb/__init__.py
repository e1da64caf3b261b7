"""eplb layer."""
