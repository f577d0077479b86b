"""Pure PyTorch + transformers: no Prefect and no MLflow in this package."""
