"""Prefect tasks: one pipeline stage each. They take paths, keys and configs, never big objects."""

from cse.tracking.redaction import mask_prefect_states

mask_prefect_states()  # a task's Failed state message never holds a credential in clear, whatever raised
