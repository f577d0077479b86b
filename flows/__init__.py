"""Prefect flows: thin compositions of the stage tasks."""

from cse import refuse_bare_name

refuse_bare_name(__name__)
