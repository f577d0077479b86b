"""Evaluation of sentence embedders (STS, retrieval, alignment/uniformity); pure Python/PyTorch.

`Evaluator(sts_table).run(embedder, mode="test" | "dev")` → `EvalResult`. No Prefect or MLflow here:
`tasks/evaluate.py` records results.
"""

from evaluation.evaluator import Evaluator
from evaluation.results import EvalResult

__all__ = ["Evaluator", "EvalResult"]
