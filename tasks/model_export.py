"""The trained encoder as an MLflow model: now `tracking.model_export` (the tracking package is the only one that
talks to MLflow). The names stay importable here: models logged before the move unpickle their python model as
`tasks.model_export.SentenceEmbeddingModel`."""

from tracking.model_export import SentenceEmbeddingModel, log_encoder_model

__all__ = ["SentenceEmbeddingModel", "log_encoder_model"]
