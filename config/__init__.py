"""Typed configuration: one place for every default.

`stages` holds the parameters of each pipeline stage (where things live, read from the environment, is
`cse.storage.settings`). Flows take these models as parameters, so every field can be overridden from a
Prefect deployment's `parameters`.
"""

from cse import refuse_bare_name
from cse.config.stages import (
    CorruptConfig,
    IngestConfig,
    NliSource,
    SentEvalSource,
    TokenizeConfig,
    WikiSource,
    local_mirror_ingest,
)

refuse_bare_name(__name__)

__all__ = [
    "CorruptConfig",
    "IngestConfig",
    "NliSource",
    "SentEvalSource",
    "TokenizeConfig",
    "WikiSource",
    "local_mirror_ingest",
]
