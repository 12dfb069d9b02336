"""`bench model`: forward/backward timing across model sizes, next to a memory calculator."""
