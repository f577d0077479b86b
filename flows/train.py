"""Training flows, one per method of the registry (config/methods.py): ingest → tokenise → (corrupt) → train → evaluate, each stage cached by its inputs.

`train-<method>` flows (one per registry entry; the Python objects are `train_<method>`, built by `train_flow`: one
line each at the end of this module, or by the module's `__getattr__` for a method without one) take a preset of config/presets.py and `overrides` (a nested dict merged into it), so any
field changes per deployment or run:
    prefect deployment run train-<method>/default -p 'overrides={"learning_rate": 0.03, "model": {"prefix_len": 12}}'
Only the stages a method needs run: the corruption stage for the methods that read corrupted sentences, NLI tokens
for methods or presets that also read NLI rows. `tags` are added to the MLflow run (sweeps use them to nest children
under a parent). The training itself is four Prefect tasks (tasks/train.py): fit, evaluate-test, evaluate-transfer
(when configured), export; `train_job` composes them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prefect import Flow, flow

from cse.config.methods import REGISTRY, MethodSpec
from cse.config.training import TrainConfig, resolve_train_config
from cse.flows.corrupt import corrupt
from cse.flows.deployment_params import deployment_merged
from cse.flows.tokenization import prepare_tokens
from cse.storage.datasets import DatasetRef
from cse.storage.signals import hangup_as_termination
from cse.tasks.backbone import evaluate_backbone
from cse.tasks.ingest import ingest_dataset
from cse.tasks.log import stage_logger
from cse.tasks.preflight import preflight_training
from cse.tasks.train import (
    TrainResult,
    evaluate_test,
    evaluate_transfer,
    export_model,
    finished_result,
    fit_job,
    job_dir,
    job_inputs,
    note_membership,
    record_result,
)
from cse.tracking.data_warnings import data_warning_tags
from cse.tracking.run_pages import sts_table


def sts_table_text(cfg: TrainConfig, metrics: dict[str, float], backbone: dict[str, Any] | None = None) -> str:
    """The job's STS test table as markdown (no final newline): this run, the backbone before training, the paper's
    row and the differences (`cse.tracking.run_pages.sts_table`)."""
    from cse.config import published

    setting = published.setting_of(cfg.method, cfg.preset, cfg.supervised)
    return sts_table(metrics, backbone, published.reference_row(published.STS, cfg.method, cfg.backbone, setting))


def train_job(
    cfg: TrainConfig,
    tokens: DatasetRef,
    corruption: DatasetRef | None,
    sts: DatasetRef,
    nli_tokens: DatasetRef | None = None,
    stop_after: int | None = None,
    extra_tags: dict[str, str] | None = None,
) -> TrainResult:
    """One training job as its stage tasks: evaluate-backbone (the backbone's own score before training, with the
    test evaluation), fit, evaluate-test and evaluate-transfer (when configured), export.

    The job's lock is held across the stages (a second flow of the same job waits, then resumes or returns the
    result). A finished job (its verified `result.json`) is returned without running any stage. A stage that fails
    after the fit leaves no result: the rerun's fit resumes at the last step (no training step runs again) and the
    later stages run again.

    Args:
        cfg: the job's training config.
        tokens: the training tokens.
        corruption: the corruption dataset (methods that read corrupted sentences), else None.
        sts: the STS dataset (dev selection, test evaluation).
        nli_tokens: the NLI tokens (methods or presets that also read NLI rows), else None.
        stop_after: interrupt the fit after that many steps (resume tests).
        extra_tags: tags added to the job's MLflow run.
    """
    hangup_as_termination()  # SIGHUP (a closed terminal, `kill -HUP`) ends the job as SIGTERM does: its run KILLED
    corruption, nli_tokens = job_inputs(cfg, corruption, nli_tokens)
    run_dir = job_dir(cfg, tokens, corruption, nli_tokens)
    with run_dir.exclusive():
        plog = stage_logger()
        if (done := finished_result(run_dir, plog)) is not None:
            plog.info("job %s already finished (MLflow run %s): returning its result", run_dir.path, done.run_id)
            note_membership(done, extra_tags)  # of the experiment that asked again for it
            return done
        # the backbone's own score before training (cached per backbone and STS data), beside every score of the job
        backbone = evaluate_backbone(cfg, sts).before() if cfg.test_evaluation else None
        fitted = fit_job(
            cfg,
            tokens,
            corruption,
            sts,
            nli_tokens=nli_tokens,
            stop_after=stop_after,
            extra_tags=extra_tags,
            backbone=backbone,
        )
        test_metrics: dict[str, float] = {}
        if cfg.test_evaluation:
            test_metrics = evaluate_test(cfg, fitted, sts, backbone)
            if cfg.transfer_evaluation or cfg.selection == "transfer":  # SentEval transfer tasks, test settings
                test_metrics = {**test_metrics, **evaluate_transfer(cfg, fitted)}
        export_model(cfg, fitted, test_metrics, tokens, corruption, nli_tokens, backbone)
        return record_result(fitted, test_metrics, backbone)


def job_datasets(cfg: TrainConfig) -> tuple[DatasetRef, DatasetRef | None, DatasetRef, DatasetRef | None]:
    """The datasets one training job reads, each built or found by its key (cache hits are verified down to their
    content hash; a damaged one is quarantined and rebuilt): (tokens, corruption or None, sts, NLI tokens or None).
    A corruption the stage wrote on its own with the same settings (`corrupt/<preset>`) is found here.

    Args:
        cfg: the job's training config.
    """
    tokens = prepare_tokens(cfg.dataset, cfg.ingest, cfg.tokenize_config(), verify=True)
    nli_tokens = None
    if cfg.needs_nli:
        nli_tokens = (
            tokens if cfg.dataset == "nli" else prepare_tokens("nli", cfg.ingest, cfg.tokenize_config(), verify=True)
        )
    sts = ingest_dataset("sts", cfg.ingest, verify=True)
    corruption = corrupt(tokens_key=tokens.key, config=cfg.corrupt, verify=True) if cfg.uses_corruption else None
    return tokens, corruption, sts, nli_tokens


def run_training(cfg: TrainConfig, stop_after: int | None = None, tags: dict[str, str] | None = None) -> TrainResult:
    """The stages of one training job, inside whichever flow calls it (`job_datasets`, then `train_job`)."""
    tokens, corruption, sts, nli_tokens = job_datasets(cfg)
    result = train_job(cfg, tokens, corruption, sts, nli_tokens=nli_tokens, stop_after=stop_after, extra_tags=tags)
    print(
        f"{cfg.method}/{cfg.preset}: MLflow run {result.run_id}, {result.steps} steps, best STS-B dev "
        f"{result.best_stsb_dev:.2f}"
        + (f" (resumed from step {result.resumed_from})" if result.resumed_from is not None else "")
    )
    if result.test_metrics:
        print("\n" + sts_table_text(cfg, result.test_metrics, result.backbone))
    return result


def train_flow(spec: MethodSpec) -> Flow:
    """The training flow of one registry method: `train-<name>`, a function named `spec.flow_function`."""

    def train(
        preset: str = "default",
        overrides: dict[str, Any] | None = None,
        stop_after: int | None = None,
        tags: dict[str, str] | None = None,
    ) -> TrainResult:
        """Train one job of this method (`stop_after` interrupts after that many steps: resume tests). In a deployment
        run `overrides` and `tags` merge into the deployment's (flows/deployment_params.py). The preflight
        (tasks/preflight.py) runs next: anything missing fails the run in seconds, before any stage."""
        overrides, tags = deployment_merged(overrides=overrides, tags=tags)
        cfg = resolve_train_config(preset, overrides, method=spec.name)
        warnings = preflight_training(cfg)
        return run_training(cfg, stop_after, {**(tags or {}), **data_warning_tags(warnings)} or None)

    train.__name__ = train.__qualname__ = spec.flow_function  # the flow object's name in this module
    return flow(name=spec.flow_name, log_prints=True, description=f"Train one {spec.title} job: {spec.summary}.")(train)


class TrainFlows(Mapping[str, Flow]):
    """Method name → its training flow, one per registry method (experiment children, tests): the flow written out
    below (`train_<method> = train_flow(...)`), else one built from the registry entry at the first use."""

    def __init__(self) -> None:
        self._built: dict[str, Flow] = {}

    def __getitem__(self, name: str) -> Flow:
        spec = REGISTRY[name]
        written = globals().get(spec.flow_function)
        if isinstance(written, Flow):
            return written
        return self._built.setdefault(name, train_flow(spec))

    def __iter__(self) -> Iterator[str]:
        return iter(REGISTRY)

    def __len__(self) -> int:
        return len(REGISTRY)


TRAIN_FLOWS = TrainFlows()


def __getattr__(name: str) -> Flow:
    """`cse.flows.train:train_<method>` of every registry method, the objects prefect.yaml's entrypoints
    (`MethodSpec.entrypoint`) name: a method with no line below has its flow built here (Prefect loads an entrypoint
    with `getattr`)."""
    method = name.removeprefix("train_")
    if name.startswith("train_") and method in REGISTRY:
        return TRAIN_FLOWS[method]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The registry methods' flows written out, so that grep finds the object each entrypoint names (one line per method;
# a method without one still has its flow, through `__getattr__` above).
train_d2cse = train_flow(REGISTRY["d2cse"])
train_simcse = train_flow(REGISTRY["simcse"])
train_dcpcse = train_flow(REGISTRY["dcpcse"])
train_diffcse = train_flow(REGISTRY["diffcse"])
train_diffaug = train_flow(REGISTRY["diffaug"])
