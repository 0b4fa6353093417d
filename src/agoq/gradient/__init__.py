"""gradient."""
