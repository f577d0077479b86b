"""cse-pipeline: contrastive sentence embeddings (D2CSE, SimCSE, DCPCSE, DiffCSE, DiffAug) with Prefect and MLflow.

The one import name of the project: its packages are `cse.config`, `cse.storage`, `cse.models`, `cse.training`,
`cse.evaluation`, `cse.tracking`, `cse.tasks`, `cse.flows` and `cse.ops`. In the checkout they stay top-level folders
(`config/`, `storage/`, ...); pyproject.toml's `package-dir` maps each under `cse`, for a regular install and an
editable one alike, so nothing installs a generic top-level name such as `models` or `config`.

`extend_path`: where a checkout's root is on `sys.path` before a regular (non-editable) install (a worker or
`python -m` started in the checkout), this folder is found first; the installed `cse` then still provides the
subpackages, which this folder does not hold.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
