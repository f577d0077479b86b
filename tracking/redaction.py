"""No credential in clear: what this process prints, logs, raises or records in MLflow is masked.

The rule is `cse.storage.secrets.redact` (URI user-info in every form, `password=`-style parameters, every known
secret). `install_redaction` (run when `tracking` is imported, so by every stage, flow and `cse` command) applies it
where the project does not write the text itself:
- every log record of the process (`cse.storage.secrets.install_log_redaction`: a record factory, and a filter on the
  root, `mlflow` and `prefect` loggers and their handlers), after remembering the environment's credentials;
- MLflow's exceptions: their message (e.g. `API request to http://user:password@host/... failed`) is masked when the
  exception is created, so a task's error, the flow's error and Prefect's Failed state message carry the masked text;
- everything sent to MLflow through `MlflowClient`, which MLflow's fluent API (`mlflow.start_run`, `log_params`,
  `set_tag`, `log_dict`, ...) also goes through: run names, params, tags (the description is a tag), dict, text and
  table artifacts, dataset inputs (name, source, tags), logged-model names, params and tags, registry tags and
  descriptions (`mask_mlflow_client`). Files logged as artifacts are the writers' business (model cards are masked
  when rendered);
- Prefect's Failed and Crashed state messages (`prefect.states.format_exception`, which builds them from the
  exception, masked by `mask_prefect_states`; the task modules install it), whatever raised;
- MLflow's "View run … at: <URI>" lines, written straight to stdout: switched off
  (`MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT`) when the tracking URI carries credentials.
Stage and training runs also re-raise any other exception whose message holds a credential as a masked copy
(`cse.storage.secrets.redacted_exception`).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys

from cse.storage.secrets import install_log_redaction, redact, redact_value, register_secrets_in

_SUPPRESS_URLS = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"


def _masking_init(original):
    def __init__(self, message, *args, **kwargs):
        original(self, redact(message), *args, **kwargs)

    __init__.cse_masking = True
    return __init__


def quiet_run_urls(tracking_uri: str | None) -> None:
    """Switch MLflow's "View run … at: <URI>" stdout lines off when `tracking_uri` holds a credential (they would
    print it; the credential is remembered as a known secret); an explicit `MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT`
    setting is left as it is."""
    if tracking_uri and redact(tracking_uri) != tracking_uri:
        register_secrets_in(tracking_uri)
        os.environ.setdefault(_SUPPRESS_URLS, "true")


def mask_mlflow_exceptions() -> None:
    """Mask credentials in the message of every `MlflowException` from now on (idempotent; imports MLflow: called by
    `cse.tracking.store`, which every module of `tracking/` that talks to MLflow goes through)."""
    from mlflow.exceptions import MlflowException

    if not getattr(MlflowException.__init__, "cse_masking", False):
        MlflowException.__init__ = _masking_init(MlflowException.__init__)  # type: ignore[method-assign]  # patching the class is the point


def _entities(items, cls):
    """Key-value entities (`Param`, `RunTag`, `InputTag`) rebuilt with their value masked."""
    return [cls(key=i.key, value=None if i.value is None else redact(i.value)) for i in items or ()]


def _dataset_inputs(inputs):
    from mlflow.entities import Dataset, DatasetInput, InputTag

    out = []
    for di in inputs or ():
        d = di.dataset
        dataset = Dataset(
            name=redact(d.name),
            digest=d.digest,
            source_type=d.source_type,
            source=redact(d.source),
            schema=d.schema,
            profile=d.profile,
        )
        out.append(DatasetInput(dataset, _entities(di.tags, InputTag)))
    return out


def _log_batch_args(args: dict) -> None:
    from mlflow.entities import Param, RunTag

    args["params"] = _entities(args.get("params"), Param)
    args["tags"] = _entities(args.get("tags"), RunTag)


# MlflowClient method → how its arguments are masked (names of string or mapping arguments, or a function)
_MASKED = {
    "create_run": ("tags", "run_name"),
    "update_run": ("name",),
    "log_param": ("value",),
    "log_batch": _log_batch_args,
    "set_tag": ("value",),
    "set_experiment_tag": ("value",),
    "log_dict": ("dictionary",),
    "log_text": ("text",),
    "log_table": ("data",),
    "log_inputs": lambda args: args.update(datasets=_dataset_inputs(args.get("datasets"))),
    "create_logged_model": ("name", "params", "tags"),
    "log_model_params": ("params",),
    "set_logged_model_tags": ("tags",),
    "create_registered_model": ("tags", "description"),
    "update_registered_model": ("description",),
    "set_registered_model_tag": ("value",),
    "create_model_version": ("tags", "description"),
    "update_model_version": ("description",),
    "set_model_version_tag": ("value",),
}


def _masked_method(original, how):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def method(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if callable(how):
            how(bound.arguments)
        else:
            for name in how:
                value = bound.arguments.get(name)
                if name == "data" and hasattr(value, "map"):  # a DataFrame: its string cells
                    bound.arguments[name] = value.map(lambda v: redact(v) if isinstance(v, str) else v)
                elif value is not None:
                    bound.arguments[name] = redact_value(value)
        return original(*bound.args, **bound.kwargs)

    method.cse_masking = True
    return method


def mask_mlflow_client() -> None:
    """Mask credentials in everything `MlflowClient` sends to the tracking server from now on (idempotent; imports
    MLflow). MLflow's fluent functions call these methods, so `mlflow.start_run(run_name=...)`, `mlflow.log_params`,
    `mlflow.set_tags`, `mlflow.log_dict`, `mlflow.log_input`, ... are masked too."""
    from mlflow import MlflowClient

    for name, how in _MASKED.items():
        original = getattr(MlflowClient, name)
        if not getattr(original, "cse_masking", False):
            setattr(MlflowClient, name, _masked_method(original, how))


def mask_prefect_states() -> None:
    """Mask credentials in the message of every Failed or Crashed state Prefect builds from an exception from now on
    (idempotent; imports Prefect: called by `cse.tasks`, and by `install_redaction` once Prefect is imported)."""
    import prefect.states

    original = prefect.states.format_exception
    if not getattr(original, "cse_masking", False):

        @functools.wraps(original)
        def format_exception(*args, **kwargs):
            return redact(original(*args, **kwargs))

        format_exception.cse_masking = True  # type: ignore[attr-defined]  # the mark that makes this idempotent
        prefect.states.format_exception = format_exception


def install_redaction() -> None:
    """Install the masking described in the module docstring (idempotent). MLflow is not imported here (rendering
    modules of `tracking` stay free of it); its exceptions and client are masked once it is (`mask_mlflow_exceptions`,
    `mask_mlflow_client`). Prefect's state messages likewise (`mask_prefect_states`)."""
    install_log_redaction()
    if "mlflow" in sys.modules:
        mask_mlflow_exceptions()
        mask_mlflow_client()
    if "prefect.states" in sys.modules:
        mask_prefect_states()
    quiet_run_urls(os.environ.get("MLFLOW_TRACKING_URI"))
