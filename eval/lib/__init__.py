"""Helpers shared by the scripts in eval/ (a module, not a script)."""
