"""Every default equals the reference setup (docs/methods-overview.md): corruption variety, fp32 evaluation,
DiffAug's cadence and seed, D2CSE ablation (b)'s discriminator learning rate, a preset for every published row,
a `default` per method."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from cse.config.evaluation import EvalConfig
from cse.config.methods import model_class
from cse.config.presets import PRESETS
from cse.config.published import published_keys
from cse.config.stages import STANDALONE_SEED, UNSUP_REFERENCE_VARIANTS, CorruptConfig
from cse.config.training import presets_for, required_variants, resolve_train_config
from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig
from cse.storage.settings import REPO_ROOT
from cse.storage.training_data import CorruptionRows, TokenRows
from cse.training.rows import TrainingRows
from tests.loops import cpu_trainer, loop_config

CORRUPTING = [(m, p) for m in PRESETS for p in PRESETS[m] if model_class(m).uses_corruption]


# ---------------------------------------------------------------- corruption variety


@pytest.mark.parametrize("method,preset", [c for c in CORRUPTING if c[1] != "single-corruption"])
def test_paper_presets_corrupt_every_view_of_every_epoch_with_generator_dropout(method, preset):
    cfg = resolve_train_config(preset, method=method)
    views_per_column = 1 if cfg.supervised else 2
    assert cfg.corrupt.variants == cfg.epochs * views_per_column
    assert cfg.corrupt.generator_dropout is True


@pytest.mark.parametrize("method", ["d2cse", "diffcse"])
def test_single_corruption_is_an_explicit_cheaper_preset(method):
    cfg = resolve_train_config("single-corruption", method=method)
    default = resolve_train_config("default", method=method)
    assert (cfg.corrupt.variants, cfg.corrupt.generator_dropout) == (1, False)
    # everything else is the default preset's
    strip = lambda c: c.model_dump(exclude={"corrupt", "preset"})
    assert strip(cfg) == strip(default)


def test_an_explicit_variant_count_is_kept():
    cfg = resolve_train_config("default", {"corrupt": {"variants": 2}}, method="d2cse")
    assert cfg.corrupt.variants == 2


def test_the_corruption_stage_alone_defaults_to_the_unsupervised_reference():
    cfg = CorruptConfig()
    assert cfg.variants is None and cfg.generator_dropout is True
    assert cfg.resolved().variants == UNSUP_REFERENCE_VARIANTS == required_variants(2, supervised=False)
    # one dataset for both spellings
    assert cfg.resolved() == CorruptConfig(variants=UNSUP_REFERENCE_VARIANTS, seed=STANDALONE_SEED)


# ---------------------------------------------------------------- the corruption follows the training seed


@pytest.mark.parametrize("method", ["d2cse", "diffcse"])
def test_the_corruption_seed_follows_the_job_seed_unless_set(method):
    assert resolve_train_config("smoke", method=method).corrupt.seed == 42  # the presets' seed: keys made before stay
    assert resolve_train_config("smoke", {"seed": 7}, method=method).corrupt.seed == 7
    pinned = resolve_train_config("smoke", {"seed": 7, "corrupt": {"seed": 42}}, method=method)
    assert (pinned.seed, pinned.corrupt.seed) == (7, 42)  # an explicit corruption seed is kept


def test_a_stand_alone_corruption_is_the_one_a_seed_42_job_reads():
    job = resolve_train_config("smoke", method="d2cse").corrupt
    alone = CorruptConfig(**job.model_dump(exclude={"seed", "variants"})).model_copy(update={"variants": job.variants})
    assert alone.seed is None and alone.resolved() == job
    with pytest.raises(ValueError, match="seed"):
        CorruptConfig(seed=-1)


def test_seeds_children_get_independent_corruption_keys():
    from cse.storage.keys import CORRUPTION_SETTINGS, corruption_key

    keys = {
        corruption_key(
            "c" * 64,
            None,
            {"name": "g"},
            "fp32",
            **resolve_train_config("smoke", {"seed": s}, method="d2cse").corrupt.model_dump(
                include=CORRUPTION_SETTINGS
            ),
        )
        for s in (42, 43, 42)
    }
    assert len(keys) == 2


def _rows(n_columns: int, variants: int) -> TrainingRows:
    """Rows whose corrupted id at position 1 names its (column, variant): 100·column + variant."""
    cols = ("sent0", "sent1", "hard_neg")[:n_columns] if n_columns > 1 else ("text",)
    seqs = {c: [np.array([101, 5, 102])] * 4 for c in cols}
    corrupted = {(c, v): [np.array([101, 100 * i + v, 102])] * 4 for i, c in enumerate(cols) for v in range(variants)}
    labels = {k: [np.array([0, 1, 0], dtype=np.int8)] * 4 for k in corrupted}
    return TrainingRows(
        TokenRows(ids=np.arange(4), seqs=seqs),
        CorruptionRows(variants, corrupted, labels),
        supervised=n_columns > 1,
        pad_id=0,
    )


def _variants_seen(rows: TrainingRows, epochs: int) -> list[tuple[int, ...]]:
    seen = []
    for e in range(epochs):
        batch = rows.batch(np.arange(2), e)
        seen.append(tuple(int(v) for v in batch.corrupted_ids[0, :, 1]))
    return seen


def test_unsupervised_views_and_epochs_read_distinct_variants():
    rows = _rows(1, required_variants(2, supervised=False))
    assert _variants_seen(rows, 2) == [(0, 1), (2, 3)]
    assert rows.reuse_description(2) == "fresh corruption for every view of every epoch"


def test_supervised_columns_read_a_fresh_variant_each_epoch():
    rows = _rows(3, required_variants(3, supervised=True))
    assert _variants_seen(rows, 3) == [(0, 100, 200), (1, 101, 201), (2, 102, 202)]
    assert rows.reuse_description(3) == "fresh corruption for every view of every epoch"


def test_single_variant_is_shared_and_said_so():
    rows = _rows(1, 1)
    assert _variants_seen(rows, 2) == [(0, 0), (0, 0)]
    assert rows.reuse_description(2) == "one corruption per sentence, shared by all views and epochs"


# ---------------------------------------------------------------- evaluation precision


def test_evaluation_is_fp32_unless_asked():
    from cse.evaluation.encode import autocast_context, embed_token_ids
    from cse.evaluation.evaluator import Evaluator

    assert EvalConfig(checkpoint="some/run").precision == "fp32"
    assert resolve_train_config("default", method="d2cse").eval_precision == "fp32"
    assert inspect.signature(Evaluator.run).parameters["precision"].default == "fp32"
    assert inspect.signature(embed_token_ids).parameters["precision"].default == "fp32"
    # fp32 means no autocast even on a GPU device; bf16 only when asked ("auto": bf16 on CUDA only)
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    for device, precision in (("cuda", "fp32"), ("cpu", "fp32"), ("cpu", "auto")):
        with autocast_context(torch.device(device), precision):
            assert not torch.is_autocast_enabled(device) and (a @ b).dtype == torch.float32, (device, precision)
    with autocast_context(torch.device("cpu"), "bf16"):
        assert torch.is_autocast_enabled("cpu") and (a @ b).dtype == torch.bfloat16
    assert (a @ b).dtype == torch.float32  # and off again afterwards
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with autocast_context(torch.device("cuda"), "tf32"):  # fp32 tensors, TF32 matmuls while active
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert not torch.is_autocast_enabled("cuda") and (a @ b).dtype == torch.float32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
    with pytest.raises(ValueError, match="unknown precision 'fp16'"):
        autocast_context(torch.device("cpu"), "fp16")


class _DevEvaluator:
    """An evaluator whose dev runs all score `score`; records the (mode, precision) of each."""

    def __init__(self, score: float) -> None:
        self.score, self.calls = score, []

    def run(self, model, mode, batch_size, precision):
        self.calls.append((mode, precision))
        return SimpleNamespace(metrics=lambda: {"stsb_dev": self.score})


def _fit(cfg, run_key: str, evaluator: _DevEvaluator) -> None:
    """`cse.training.job.fit` of `cfg` on `_rows(1, 2)` on the CPU in fp32, nothing logged."""
    from cse.storage.runs import RunDir
    from cse.training.job import fit

    cpu = torch.device("cpu")
    fit(
        cfg,
        _rows(1, 2),
        None,
        RunDir("d2cse", run_key),
        "run",
        cpu,
        "fp32",
        evaluator,
        lambda p: None,
        lambda m, s: None,
    )


def test_training_selects_and_tests_in_the_configured_eval_precision(tiny_bert_dir, tokenizer, tmp_path):
    """`fit` hands `eval_precision` to every dev evaluation (fp32 by default, even when training runs in bf16)."""
    for asked, expected in ((None, "fp32"), ("bf16", "bf16")):
        over = {
            "backbone": str(tiny_bert_dir),
            "max_steps": 2,
            "eval_steps": 1,
            "batch_size": 2,
            "log_steps": 1,
            "model": {"prefix_len": 2},
        }
        if asked:
            over["eval_precision"] = asked
        spy = _DevEvaluator(50.0)
        _fit(resolve_train_config("smoke", over, method="d2cse"), f"spy-{expected}", spy)
        assert spy.calls == [("dev", expected), ("dev", expected)]


# ---------------------------------------------------------------- DiffAug cadence and seed


@pytest.mark.parametrize("preset", ["default", "semi", "semi-aux", "sup"])
def test_diffaug_evaluates_every_50_steps_with_seed_0(preset):
    cfg = resolve_train_config(preset, method="diffaug")
    assert (cfg.eval_steps, cfg.seed) == (50, 0)


# ---------------------------------------------------------------- D2CSE ablation (b)


def test_ablation_b_discriminator_has_its_own_group_and_learning_rate(tiny_bert_dir, tokenizer, tmp_path):
    torch.manual_seed(0)
    model = D2CSE(
        D2CSEModelConfig(
            backbone=str(tiny_bert_dir), prefix_len=2, discriminator_prompts=False, train_discriminator=True
        )
    )
    groups = model.parameter_groups("main")
    disc = {id(p) for p in model.discriminator.parameters()}
    assert [g.get("lr") for g in groups] == [None, 7e-6]
    assert {id(p) for p in groups[1]["params"]} == disc
    assert not any(id(p) in disc for p in groups[0]["params"])
    assert sum(len(g["params"]) for g in groups) == len([p for p in model.parameters() if p.requires_grad])

    logged = []
    loop = loop_config(learning_rate=0.02, max_steps=1)
    trainer = cpu_trainer(model, _rows(1, 2), loop, tmp_path / "state", log_metrics=lambda m, s: logged.append(m))
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [0.02, 7e-6]
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.run()
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters() if p.requires_grad}
    # AdamW's first step moves each tensor by at most its group's learning rate
    disc_moves = [v for n, v in moved.items() if n.startswith("discriminator.")]
    prompt_moves = [v for n, v in moved.items() if n.startswith("encoder.prefix_encoder")]
    assert 0 < max(disc_moves) <= 7e-6 * 1.001
    assert max(prompt_moves) > 0.01
    assert logged[0]["learning_rate_discriminator"] == 0.0  # the decay scales every group (1 step: to 0)


def test_the_discriminator_learning_rate_must_be_positive(tiny_bert_dir):
    with pytest.raises(ValueError, match="discriminator_learning_rate"):
        D2CSEModelConfig(backbone=str(tiny_bert_dir), discriminator_learning_rate=0.0)


# ---------------------------------------------------------------- published rows and presets


@pytest.mark.parametrize("key", sorted(published_keys()))
def test_every_published_row_has_a_preset(key):
    presets = presets_for(key)
    assert presets, f"no preset reproduces the published row {key}"


def test_published_row_map_names_the_canonical_presets():
    assert presets_for(("d2cse", "bert-base", "unsup"))[0] == "default"
    assert presets_for(("diffcse", "bert-base", "sup")) == ["sup"]
    assert presets_for(("simcse", "roberta-large", "sup")) == ["sup-roberta-large"]
    assert presets_for(("dcpcse", "roberta-large", "sup")) == ["sup-roberta-large"]
    assert presets_for(("diffaug", "bert-base", "semi"))[0] == "default"


def test_every_method_has_a_default_preset_and_deployment_for_experiment_children():
    spec = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
    deployments = {(d["entrypoint"].split(":")[1], d["name"]) for d in spec["deployments"]}
    for method in PRESETS:
        assert "default" in PRESETS[method]
        assert (f"train_{method}", "default") in deployments


def test_the_job_seed_fixes_the_initial_weights(tiny_bert_dir, monkeypatch):
    """`fit` seeds before building the model: the initial prompts and heads follow `seed`, not earlier RNG use."""
    import cse.training.job as train_task

    built = []
    build = train_task.build_model

    def spy(cfg, device):
        model = build(cfg, device)
        built.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
        return model

    monkeypatch.setattr(train_task, "build_model", spy)

    def initial(seed: int, noise: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(noise)  # whatever ran before in this process
        torch.rand(noise + 1)
        over = {
            "backbone": str(tiny_bert_dir),
            "max_steps": 1,
            "batch_size": 2,
            "seed": seed,
            "model": {"prefix_len": 2},
        }
        _fit(resolve_train_config("smoke", over, method="d2cse"), f"seed-{seed}-{noise}", _DevEvaluator(1.0))
        return built[-1]

    a, b, c = initial(1, 0), initial(1, 5), initial(2, 0)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a)
