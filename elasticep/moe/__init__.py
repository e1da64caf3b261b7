"""moe layer."""
