"""activation."""
