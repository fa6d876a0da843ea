"""shaky."""
