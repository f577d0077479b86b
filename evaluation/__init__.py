"""Evaluation of sentence embedders (STS, retrieval, alignment/uniformity); pure Python/PyTorch.

`Evaluator(sts_table).run(embedder, mode="test" | "dev")` → `EvalResult`. No Prefect or MLflow here:
`tasks/evaluate.py` records results.
"""

from cse import refuse_bare_name
from cse.evaluation.evaluator import Evaluator
from cse.evaluation.results import EvalResult

refuse_bare_name(__name__)

__all__ = ["Evaluator", "EvalResult"]
