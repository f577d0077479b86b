"""Prefect flows: thin compositions of the stage tasks."""
