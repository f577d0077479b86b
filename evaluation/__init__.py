"""Evaluation of sentence embedders (STS, retrieval, alignment/uniformity); pure Python/PyTorch.

`Evaluator(sts_table).run(embedder, mode="test" | "dev")` → `EvalResult`. No Prefect or MLflow here:
`tasks/evaluate.py` records results.
"""

from cse.evaluation.evaluator import Evaluator
from cse.evaluation.results import EvalResult

__all__ = ["Evaluator", "EvalResult"]
