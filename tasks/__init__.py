"""Prefect tasks: one pipeline stage each. They take paths, keys and configs, never big objects."""
