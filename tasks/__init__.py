"""Prefect tasks: one pipeline stage each. They take paths, keys and configs, never big objects."""

from cse import refuse_bare_name
from cse.tracking.redaction import mask_prefect_states

refuse_bare_name(__name__)

mask_prefect_states()  # a task's Failed state message never holds a credential in clear, whatever raised
