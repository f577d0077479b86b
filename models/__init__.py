"""Pure PyTorch + transformers: no Prefect and no MLflow in this package."""

from cse import refuse_bare_name

refuse_bare_name(__name__)
