"""The one masking rule for credentials, and where it is applied.

`redact(text)` is the rule. It masks:
- the user-info of every `scheme://user-info@host` URI: the password (`http://user:***@host`), or the whole user-info
  when it has no `:` (a token, `https://***@github.com`). The user-info runs from `://` to the *last* `@` before the
  host's end (`/`, `?`, `#`, whitespace), so a password holding quotes (`Pw'Secret9`), a raw `@` (`p@ss`), `:` or a
  percent-encoding (`p%40ss`) is masked whole;
- `password=` / `token=` / `secret=` / `api_key=`-style parameters (query strings, libpq `key=value` DSNs, quoted or
  not) and the same keys in a mapping's text (`{'password': '...'}`);
- every *known secret* wherever it appears: a password seen in a URI or a parameter, or the value (8 characters or
  more) of an environment variable named like a secret (`register_secrets_in`, `register_environment`) is remembered with its percent-decoded and -encoded forms and the
  pieces a parser makes of it when it splits at a quote, `@`, `:` or `/` (libpq reading `postgresql://u:p@ss@h` says
  `failed to resolve host 'ss@h'`). `redact` remembers what it masks, so a password masked once is masked in every
  later text. Pieces shorter than `MIN_SECRET` characters are not masked on their own (they would mask ordinary
  words); in a URI or parameter they are masked by the patterns above.

`redact_value` applies the rule to every string of a nested value (a config dump, MLflow params, a card's facts).
Where the rule is applied, so that no credential leaves the process in clear:
- every log record of the process (`install_log_redaction`: a record factory, and a filter on the root, `mlflow` and
  `prefect` loggers and their handlers, Prefect's API log handler included);
- exceptions: MLflow's (`cse.tracking.redaction`), and any other a stage or training run re-raises
  (`redacted_exception`), so a task's error, the flow's error and Prefect's Failed state message;
- everything the project sends to MLflow: run names, params, tags (descriptions are the tag `mlflow.note.content`),
  dict and text artifacts, dataset inputs, logged-model and registry fields (`cse.tracking.redaction`);
- Prefect artifacts (`cse.tracking.reporting`), model cards (`cse.tracking.model_card`), the source location in a
  dataset's manifest (`cse.storage.sources`), and every message of the `cse` command and the scripts
  (`scripts/services.sh`, `scripts/team.sh` hold the same URI pattern in `sed`), every line `cse run` prints (the
  Prefect and MLflow pages, built on URLs that may hold user-info: `cse.ops.deployments`);
- user-given free text that is stored: an evaluation's label and experiment (`cse.config.evaluation`), the label of
  every evaluation record and the text of every `evaluations` row (`cse.tasks.evaluate`, `cse.storage.evaluations`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote

MASK = "***"
MIN_SECRET = 4  # a known secret (or a piece of one) shorter than this is masked only inside a URI or parameter
MIN_ENV_SECRET = 8  # a variable named like a secret holding less (`USE_AUTH_TOKEN=false`) holds no secret

_SCHEME = r"[A-Za-z][A-Za-z0-9+.\-]*://"
# user-info: everything from `://` to the last `@` before the host's end (greedy, backtracking to that `@`)
_URI_USERINFO = re.compile(rf"(?P<scheme>{_SCHEME})(?P<userinfo>[^/?#\s]*)@")
_SECRET_NAMES = r"password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|client[_-]?secret"
# `password=...` (query strings, libpq DSNs, keyword arguments in a repr): a quoted value (libpq's `'...'` with `\'`
# escapes), or an unquoted one up to `&` or a space (libpq's rule: `password=abc)def` is that whole password)
_SECRET_PARAM = re.compile(
    rf"(?i)(?P<name>\b(?:{_SECRET_NAMES})=)(?P<secret>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^&\s]+)"
)
# a mapping's text: `'password': 'x'`, `"api_key": "x"` (these keys exactly: `"mask_token": "[MASK]"` is no secret)
_SECRET_ITEM = re.compile(
    r"(?i)(?P<name>(?P<q>['\"])(?:password|passwd|secret|api[_-]?key|access[_-]?key|client[_-]?secret)(?P=q)\s*:\s*)"
    r"(?P<secret>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")"
)
_SPLITS = re.compile(r"['\"@:/\\]")  # where parsers cut a credential that holds these characters
_SECRET_ENV = re.compile(r"(?i)(password|passwd|secret|token|api_?key|access_?key)$")

_known: set[str] = set()
_known_pattern: re.Pattern | None = None
_lock = threading.Lock()


# values a `token=`/`password=` may show that are no secret (`token=None` in a repr): never remembered
_NOT_SECRETS = frozenset({"none", "null", "true", "false", "***", "<redacted>"})


def _variants(secret: str) -> set[str]:
    """A secret, its percent-decoded and -encoded forms, and the pieces a parser cuts it into."""
    forms = {secret, secret.replace("\\'", "'"), unquote(secret), quote(unquote(secret), safe="")}
    pieces = {p for f in forms for p in _SPLITS.split(f)}
    return {v for v in forms | pieces if len(v) >= MIN_SECRET and not _no_secret(v)}


def _no_secret(value: str) -> bool:
    """`None`, `null`, `true`, `false` or a mask, also as a repr's `None)` or `None,`."""
    return value.lower().rstrip(")]},;'\"") in _NOT_SECRETS or not value.strip("*")


def register_secret(secret: str) -> None:
    """Remember `secret` (and its variants: see the module docstring) so that `redact` masks it wherever it appears.

    Args:
        secret: a password, token or key; its variants shorter than `MIN_SECRET` characters are not remembered.
    """
    global _known_pattern
    secret = secret.strip("'\"")
    if _no_secret(secret):
        return
    new = _variants(secret) - _known
    if not new:
        return
    with _lock:
        _known.update(new)
        # longest first, so a whole secret is masked before its pieces
        _known_pattern = re.compile("|".join(re.escape(s) for s in sorted(_known, key=len, reverse=True)))


def register_secrets_in(text: str) -> None:
    """Remember every credential written in `text` (URI user-info, `password=`-style parameters).

    Args:
        text: a URI, DSN, message or any text.
    """
    for m in _URI_USERINFO.finditer(text):
        if ":" in m["userinfo"] and (secret := m["userinfo"].split(":", 1)[1]):
            register_secret(secret)
    for pattern in (_SECRET_PARAM, _SECRET_ITEM):
        for m in pattern.finditer(text):
            register_secret(m["secret"])


def register_environment(environ: Mapping[str, str] | None = None) -> None:
    """Remember the credentials the environment holds: those written in any variable's value (a tracking URI, a
    Prefect API or database URL, a DSN) and the value of every variable named like a secret (`HF_TOKEN`,
    `MLFLOW_TRACKING_PASSWORD`, `PREFECT_API_KEY`, ...).

    Args:
        environ: the variables; `os.environ` when None.
    """
    for name, value in (os.environ if environ is None else environ).items():
        if not value:
            continue
        if _SECRET_ENV.search(name) and len(value) >= MIN_ENV_SECRET:
            register_secret(value)
        if "@" in value or "=" in value:
            register_secrets_in(value)


def _mask_userinfo(m: re.Match) -> str:
    userinfo = m["userinfo"]
    if ":" in userinfo:
        user, secret = userinfo.split(":", 1)
        if secret:
            register_secret(secret)
        return f"{m['scheme']}{user}:{MASK}@"
    if userinfo:  # a token, or a user name: masked here, not remembered (`postgres@host` would mask every "postgres")
        return f"{m['scheme']}{MASK}@"
    return m.group(0)


def _mask_value(m: re.Match) -> str:
    register_secret(m["secret"])
    return f"{m['name']}{MASK}"


def mask_uris(text: str) -> str:
    """`text` with the user-info of its URIs masked: the URI part of `redact`, the rule `scripts/services.sh` and
    `scripts/team.sh` also follow (in `sed`)."""
    return _URI_USERINFO.sub(_mask_userinfo, text) if "@" in text else text


def redact(text: object) -> str:
    """`text` with every credential in it masked (the rule in the module docstring). Use it on every URI, message or
    value the project prints, logs or records.

    Args:
        text: anything; its `str` is masked.

    Returns:
        The masked text (the same text when it holds no credential).

    Examples:
        >>> from cse.storage.secrets import redact
        >>> redact("postgresql://cse:p@ss'Wh1stle9@db:5432/mlflow")
        'postgresql://cse:***@db:5432/mlflow'
        >>> redact("failed to resolve host 'ss'Wh1stle9@db'")  # a piece of the password seen above
        "failed to resolve host 'ss'***@db'"
    """
    out = mask_uris(str(text))
    if "=" in out:
        out = _SECRET_PARAM.sub(_mask_value, out)
    if ":" in out:
        out = _SECRET_ITEM.sub(_mask_value, out)
    if _known_pattern is not None:
        out = _known_pattern.sub(MASK, out)
    return out


def redact_value(value: Any) -> Any:
    """`value` with `redact` applied to every string in it: mappings (keys and values), lists, tuples and sets are
    rebuilt, other values are returned as they are.

    Args:
        value: a config dump, a mapping of params or tags, a list, a string, ...

    Returns:
        A masked copy (the value itself where nothing is a string).
    """
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {redact_value(k): redact_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(redact_value(v) for v in value)
    return value


def redacted_exception(exc: BaseException) -> BaseException:
    """`exc` itself when its message holds no credential; otherwise an exception of the same type (RuntimeError when
    the type cannot be rebuilt from a message) whose message is `redact`ed. Raise it `from None` so that the original
    text (in the chain) is never printed."""
    text = str(exc)
    if redact(text) == text:
        return exc
    try:
        clean = type(exc)(redact(text))
        if redact(str(clean)) != str(clean):
            raise TypeError("message not taken as given")
    except Exception:  # noqa: BLE001 - a type with another constructor
        clean = RuntimeError(f"{type(exc).__name__}: {redact(text)}")
    return clean.with_traceback(exc.__traceback__)


class RedactingFilter(logging.Filter):
    """A logging filter that masks credentials (`redact`) in a record's message and in its formatted traceback.
    Installed on the handlers of the root, `mlflow` and `prefect` loggers by `install_log_redaction`; the same
    rewrite is applied to every record this process creates (the record factory), whoever logs it."""

    def filter(self, record: logging.LogRecord) -> bool:
        _redact_record(record)
        return True


def _redact_record(record: logging.LogRecord) -> logging.LogRecord:
    try:
        text = record.getMessage()
    except Exception:  # noqa: BLE001 - a malformed record is logging's business, not ours
        return record
    if (clean := redact(text)) != text:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[1] is not None and not getattr(record, "_cse_redacted", False):
        formatted = logging.Formatter().formatException(record.exc_info)
        if (clean := redact(formatted)) != formatted:
            record.exc_text = clean
        record._cse_redacted = True
    if record.stack_info and (clean := redact(record.stack_info)) != record.stack_info:
        record.stack_info = clean
    return record


_REDACTION_INSTALLED = False
REDACTED_LOGGERS = ("", "mlflow", "prefect", "prefect.flow_runs", "prefect.task_runs")


def install_log_redaction() -> None:
    """Mask credentials in every log record of this process (idempotent): a record factory rewrites each record as it
    is created, and a `RedactingFilter` sits on the root, `mlflow` and `prefect` loggers and their handlers (the
    Prefect API handler included), so MLflow's and Prefect's own messages (a tracking URI with a password in an
    exception text, a Failed state's message) reach no console, file or server in clear. The environment's
    credentials are remembered first (`register_environment`)."""
    global _REDACTION_INSTALLED
    register_environment()
    if not _REDACTION_INSTALLED:
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            return _redact_record(previous(*args, **kwargs))

        logging.setLogRecordFactory(factory)
        _REDACTION_INSTALLED = True
    for name in REDACTED_LOGGERS:
        logger = logging.getLogger(name)
        for target in (logger, *logger.handlers):
            if not any(isinstance(f, RedactingFilter) for f in target.filters):
                target.addFilter(RedactingFilter())
