"""No credential in clear: what this process prints, logs or raises about MLflow and Prefect is masked.

`cse.config.settings.redact` masks the password of `scheme://user:password@host` URIs and `password=` / `token=`
parameters. `install_redaction` (run when `tracking` is imported, so by every stage, flow and `cse` command) applies
it where the project does not write the text itself:
- every log record of the process (`cse.config.settings.install_log_redaction`: a record factory, and a filter on the
  root, `mlflow` and `prefect` loggers and their handlers);
- MLflow's exceptions: their message (e.g. `API request to http://user:password@host/... failed`) is masked when the
  exception is created, so a task's error, the flow's error and Prefect's Failed state message carry the masked text;
- MLflow's "View run … at: <tracking URI>" lines, written straight to stdout: switched off
  (`MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT`) when the tracking URI carries credentials.
Stage and training runs also re-raise any other exception whose message holds a credential as a masked copy
(`cse.config.settings.redacted_exception`).
"""

from __future__ import annotations

import os
import sys

from cse.config.settings import install_log_redaction, redact

_SUPPRESS_URLS = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"


def _masking_init(original):
    def __init__(self, message, *args, **kwargs):
        original(self, redact(message), *args, **kwargs)

    __init__.cse_masking = True
    return __init__


def quiet_run_urls(tracking_uri: str | None) -> None:
    """Switch MLflow's "View run … at: <URI>" stdout lines off when `tracking_uri` holds a credential (they would
    print it); an explicit `MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT` setting is left as it is."""
    if tracking_uri and redact(tracking_uri) != tracking_uri:
        os.environ.setdefault(_SUPPRESS_URLS, "true")


def mask_mlflow_exceptions() -> None:
    """Mask credentials in the message of every `MlflowException` from now on (idempotent; imports MLflow: called by
    `cse.tracking.store`, which every module of `tracking/` that talks to MLflow goes through)."""
    from mlflow.exceptions import MlflowException

    if not getattr(MlflowException.__init__, "cse_masking", False):
        MlflowException.__init__ = _masking_init(MlflowException.__init__)


def install_redaction() -> None:
    """Install the masking described in the module docstring (idempotent). MLflow is not imported here (rendering
    modules of `tracking` stay free of it); its exceptions are masked once it is (`mask_mlflow_exceptions`)."""
    install_log_redaction()
    if "mlflow" in sys.modules:
        mask_mlflow_exceptions()
    quiet_run_urls(os.environ.get("MLFLOW_TRACKING_URI"))
