"""Distributed training (models/distributed.py, training/loop.py): two gloo processes on CPU compute exactly what one
process computes on the concatenated batch — loss, metrics, the gradients of every trainable tensor (summed over
ranks), BatchNorm running statistics, and whole training runs through the Trainer (with a kill and resume) — also
with each rank's rows in gradient-cached chunks (models/grad_cache.py).

Dropout is off everywhere (backbone p = 0, prefix dropout 0), so the two runs see the same function. The methods with
the BN-MLP (D2CSE, DiffCSE) run in float64: the CLS states of a random tiny BERT are nearly equal across rows, and
BatchNorm normalises their tiny differences, which amplifies float32 rounding (~1e-4 relative on some gradients)
in either computation; in float64 the two agree to ~1e-13 apart from the float32 casts inside the losses. The
others run in float32, the training dtype."""

from __future__ import annotations

import itertools
import os
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cse.models.batching import TrainBatch
from cse.models.distributed import (
    all_reduce_gradients,
    check_replicated,
    convert_batchnorm,
    gather_with_local_grad,
    shard_batch,
    shard_bounds,
)
from tests.batches import default_dtype, tiny_bert_config
from tests.loops import cpu_trainer, heads_ingest, loop_config
from tests.ports import free_ports

WORLD = 2
SMALL_VOCAB = 120
DIFFAUG_TOKENS = 8
SENTENCES = [
    "a man is playing a guitar on the stage .",
    "the cat sleeps",
    "two dogs run on the beach",
    "it rains",
    "a woman slices an onion",
    "kids play football in the park today",
    "rain",
]


# ------------------------------------------------------------------------------------------------ models and batches
def _backbone(vocab_size: int):
    from transformers import BertModel

    return BertModel(tiny_bert_config(vocab_size, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _tokenizer():
    from cse.models.loading import PACKAGED_MINILM, load_tokenizer

    return load_tokenizer(PACKAGED_MINILM)


def _build(kind: str):
    """The model of a test case, initialised from seed 0 (the same in every process)."""
    torch.manual_seed(0)
    if kind == "diffaug":
        from cse.models.methods.diffaug import DiffAug, DiffAugConfig

        tok = _tokenizer()
        return DiffAug(
            DiffAugConfig(
                backbone="tiny",
                prefix_len=4,
                prefix_dropout=0.0,
                max_sentence_tokens=DIFFAUG_TOKENS,
                denoise_copies=DIFFAUG_TOKENS + 4,
            ),
            backbone=_backbone(len(tok)),
            tokenizer=tok,
        )
    backbone = _backbone(SMALL_VOCAB)
    if kind == "simcse":
        from cse.models.methods.simcse import SimCSE, SimCSEConfig

        return SimCSE(SimCSEConfig(backbone="tiny", hard_negative_weight=0.7), backbone=backbone)
    if kind == "dcpcse":
        from cse.models.methods.dcpcse import DCPCSE, DCPCSEConfig

        return DCPCSE(DCPCSEConfig(backbone="tiny", prefix_len=4, prefix_dropout=0.0), backbone=backbone)
    if kind == "d2cse":
        from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig

        return D2CSE(
            D2CSEModelConfig(backbone="tiny", prefix_len=4, prefix_dropout=0.0, rtd_weight=0.5), backbone=backbone
        )
    if kind == "diffcse":
        from cse.models.methods.diffcse import DiffCSE, DiffCSEConfig

        return DiffCSE(
            DiffCSEConfig(backbone="tiny", rtd_weight=0.5, rtd_mean_over_padding=False, hard_negative_weight=0.3),
            backbone=backbone,
        )
    raise ValueError(kind)


def _random_batch(rows: int, n: int, seed: int, corruption: bool) -> TrainBatch:
    """`(rows, n, 12)` ids of random lengths (right-padded with 0, [CLS]=1 first), with corruptions if asked."""
    g = torch.Generator().manual_seed(seed)
    length = 12
    lengths = torch.randint(4, length + 1, (rows, n), generator=g)
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).long()
    ids = torch.randint(5, SMALL_VOCAB, (rows, n, length), generator=g) * mask
    ids[..., 0] = 1
    if not corruption:
        return TrainBatch(ids, mask)
    corrupted = torch.where(
        (torch.rand(ids.shape, generator=g) < 0.3) & (mask == 1),
        torch.randint(5, SMALL_VOCAB, ids.shape, generator=g),
        ids,
    )
    corrupted[..., 0] = 1
    return TrainBatch(ids, mask, corrupted, None)


def _sentence_batch(tokenizer, rows: int) -> TrainBatch:
    enc = tokenizer(SENTENCES[:rows], padding=True, return_tensors="pt")
    return TrainBatch(enc["input_ids"].unsqueeze(1).repeat(1, 2, 1), enc["attention_mask"].unsqueeze(1).repeat(1, 2, 1))


# name → (model kind, batch maker, phase, dtype); 7-row batches split 4 + 3 over the two ranks
CASES = {
    "simcse_supervised_hard_negative_weight": ("simcse", lambda: _random_batch(7, 3, 1, False), "main", torch.float32),
    "dcpcse": ("dcpcse", lambda: _random_batch(8, 2, 2, False), "main", torch.float32),
    "d2cse_bn_rtd_over_padding": ("d2cse", lambda: _random_batch(8, 2, 3, True), "main", torch.float64),
    "diffcse_supervised_rtd_real_tokens": ("diffcse", lambda: _random_batch(7, 3, 4, True), "main", torch.float64),
    "diffaug_joint_denoised": ("diffaug", lambda: _sentence_batch(_tokenizer(), 7), "joint", torch.float32),
}


def _step(kind: str, batch: TrainBatch, phase: str, dtype: torch.dtype, chunk: int | None = None) -> dict:
    """Loss, metrics, trainable gradients (summed over ranks when distributed) and buffers of one training step in
    `dtype`; `chunk`: its per-row passes in cached chunks of that many rows (models/grad_cache.py)."""
    from cse.models.grad_cache import RowChunks

    with default_dtype(dtype):
        model = _build(kind)
        model.use_grad_cache(RowChunks(chunk))
        model.train()
        convert_batchnorm(model)  # as the Trainer does; identical to nn.BatchNorm1d outside distributed training
        if dist.is_initialized():
            batch = shard_batch(batch, dist.get_rank(), dist.get_world_size())
        out = model.training_step(batch, step=0, phase=phase)
        out.loss.backward()
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        all_reduce_gradients(params.values())
        return {
            "loss": out.loss.detach(),
            "metrics": {k: v.detach().clone() for k, v in out.metrics.items()},
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in params.items()},
            "buffers": {n: b.clone() for n, b in model.named_buffers() if "running" in n},
        }


# ------------------------------------------------------------------------------------------------ trainer runs
def _training_rows():
    from cse.storage.training_data import CorruptionRows, TokenRows
    from cse.training.rows import TrainingRows

    rng = np.random.default_rng(0)
    seqs = [
        np.concatenate([[1], rng.integers(5, SMALL_VOCAB, rng.integers(3, 14)), [2]]).astype(np.int64)
        for _ in range(22)
    ]
    corrupted, labels = {}, {}
    for v in range(2):
        cs = []
        for s in seqs:
            c = s.copy()
            pick = rng.random(len(s)) < 0.3
            pick[0] = pick[-1] = False
            c[pick] = rng.integers(5, SMALL_VOCAB, pick.sum())
            cs.append(c)
        corrupted[("text", v)], labels[("text", v)] = cs, [(c != s).astype(np.int8) for c, s in zip(cs, seqs)]
    tokens = TokenRows(ids=np.arange(len(seqs)), seqs={"text": seqs})
    return TrainingRows(
        tokens, CorruptionRows(variants=2, corrupted=corrupted, labels=labels), supervised=False, pad_id=0
    )


class Recorder:
    def __init__(self):
        self.logged, self.saved, self.evaluated = [], [], 0

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def save_best(self, model, step, score):
        self.saved.append((step, score))

    def evaluate(self, model) -> float:
        """A deterministic dev score of the current weights."""
        self.evaluated += 1
        model.eval()
        with torch.no_grad():
            ids = torch.tensor([[1, 7, 8, 9, 2], [1, 7, 8, 10, 2]])
            e = model.embed(ids, torch.ones_like(ids))
        model.train()
        return float(torch.nn.functional.cosine_similarity(e[0:1], e[1:2]))


def _train(state_dir: Path, stop_after: int | None = None, chunk: int | None = None):
    """D2CSE (BN-MLP + RTD) in float64 through the Trainer: 22 rows, global batch 6 (the last batch of an epoch has 4
    rows); `chunk`: grad_cache's chunk size."""
    from cse.models.checkpoint import trainable_state_dict
    from cse.training.loop import StopAfter, Trainer, TrainingInterrupted

    shape = {"batch_size": 6, "epochs": 2, "grad_clip": 0.5, "seed": 5, "eval_steps": 3, "checkpoint_steps": 3}
    loop = loop_config(**shape, log_steps=2, grad_cache_chunk_size=chunk)
    with default_dtype(torch.float64):
        model, rec = _build("d2cse"), Recorder()
        trainer = Trainer(
            model,
            _training_rows(),
            loop,
            torch.device("cpu"),
            state_dir,
            rec.save_best,
            rec.evaluate,
            rec.log,
            hooks=[StopAfter(stop_after)] if stop_after is not None else [],
        )
        try:
            result = trainer.run()
        except TrainingInterrupted:
            return None
    return {
        "weights": trainable_state_dict(model),
        "logged": rec.logged,
        "saved": rec.saved,
        "evaluated": rec.evaluated,
        "best": (result.best_score, result.best_step),
        "steps": result.steps,
        "resumed_from": result.resumed_from,
    }


class LocalMean(torch.nn.Module):
    """A method whose loss is a mean over the rank's own rows only (not the global objective)."""

    phases = ("main",)

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def phase_parameters(self, phase):
        return [self.w]

    def training_step(self, batch, step=0, phase="main"):
        from cse.models.method import StepOutput

        return StepOutput((batch.input_ids.float() @ self.w).mean())


def _local_mean_is_refused(tmp: Path) -> str:
    from cse.storage.training_data import TokenRows
    from cse.training.rows import TrainingRows

    seqs = [np.array([1, i + 3, 2]) for i in range(8)]
    rows = TrainingRows(TokenRows(ids=np.arange(8), seqs={"text": seqs}), None, supervised=False, pad_id=0)
    trainer = cpu_trainer(LocalMean(), rows, loop_config(learning_rate=0.1, deterministic=False), tmp / "local_mean")
    try:
        trainer.run()
    except RuntimeError as e:
        return str(e)
    return ""


# ------------------------------------------------------------------------------------------------ the two ranks
def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        out_dir = Path(out)
        # cached: each rank's rows (8 or 6, 12 or 9) in grad_cache chunks of 3 (a short last one on some ranks)
        res: dict = {
            which: {
                name: _step(kind, make(), phase, dtype, chunk) for name, (kind, make, phase, dtype) in CASES.items()
            }
            for which, chunk in (("steps", None), ("cached", 3))
        }

        x = torch.arange(6.0).view(3, 2).add(10 * rank)[: 3 - rank].clone().requires_grad_(True)  # 3 rows, then 2
        gathered = gather_with_local_grad(x)
        (gathered * torch.arange(1.0, 11.0).view(5, 2)).sum().backward()
        res["gather"] = (gathered.detach(), x.grad)
        try:
            check_replicated(torch.tensor(1.0 + rank), "probe")
            res["replicated_check"] = ""
        except RuntimeError as e:
            res["replicated_check"] = str(e)

        for prefix, chunk in (("", None), ("cached_", 2)):
            res[f"{prefix}straight"] = _train(out_dir / f"{prefix}straight", chunk=chunk)
            assert _train(out_dir / f"{prefix}killed", stop_after=4, chunk=chunk) is None
            res[f"{prefix}resumed"] = _train(out_dir / f"{prefix}killed", chunk=chunk)
        res["local_mean"] = _local_mean_is_refused(out_dir)
        torch.save(res, out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(WORLD, free_ports()[0], str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _close(a, b, what: str, atol=1e-6, rtol=1e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------------------------ tests
def _assert_equal_step(got: dict, single: dict, what: str) -> None:
    """One rank's step (loss, metrics, gradients, BatchNorm statistics) equals the single-process step."""
    _close(got["loss"], single["loss"], f"{what} loss")
    assert got["metrics"].keys() == single["metrics"].keys()
    for k in single["metrics"]:
        _close(got["metrics"][k], single["metrics"][k], f"{what} metric {k}")
    assert got["grads"].keys() == single["grads"].keys()
    for n, g in single["grads"].items():
        if g is None:
            assert got["grads"][n] is None, n
        else:
            _close(got["grads"][n], g, f"{what} gradient of {n}")
    for n, b in single["buffers"].items():
        _close(got["buffers"][n], b, f"{what} buffer {n}")


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("which", ["steps", "cached"])
def test_loss_and_summed_gradients_equal_one_process_on_the_concatenated_batch(ranks, which, name):
    """`cached`: grad_cache under data parallelism, each rank's rows in chunks of 3, the loss on the all-gathered
    batch."""
    kind, make, phase, dtype = CASES[name]
    single = _step(kind, make(), phase, dtype)
    assert any(g is not None for g in single["grads"].values())
    for r, res in enumerate(ranks):
        _assert_equal_step(res[which][name], single, f"rank {r} {which}")
    if kind in ("d2cse", "diffcse"):
        assert single["buffers"], "the BN-MLP's running statistics are compared"


def test_trainer_with_cached_chunks_on_two_ranks_equals_one_process(ranks, tmp_path):
    single = _train(tmp_path / "single")
    for r in ranks:
        assert r["cached_straight"]["steps"] == 8
        for k, w in single["weights"].items():
            _close(r["cached_straight"]["weights"][k], w, f"weight {k} after cached training", atol=2e-5, rtol=1e-4)
    logged = [m for _, m in ranks[0]["cached_straight"]["logged"] if "peak_memory_gb" in m]
    assert logged and all(m["peak_memory_gb"] > 0 for m in logged)  # the steps' peak resident set (CPU)


def test_gather_keeps_only_the_local_gradient_with_uneven_rows(ranks):
    expected = torch.cat([torch.arange(6.0).view(3, 2), torch.arange(6.0).view(3, 2).add(10)[:2]])
    weights = torch.arange(1.0, 11.0).view(5, 2)
    (g0, grad0), (g1, grad1) = ranks[0]["gather"], ranks[1]["gather"]
    assert torch.equal(g0, expected) and torch.equal(g1, expected)
    assert torch.equal(grad0, weights[:3]) and torch.equal(grad1, weights[3:])


def test_a_loss_that_differs_by_rank_is_refused(ranks):
    assert all("differs across ranks" in r[check] for r in ranks for check in ("replicated_check", "local_mean"))


def test_trainer_on_two_ranks_equals_one_process_and_only_rank0_evaluates_and_logs(ranks, tmp_path):
    single = _train(tmp_path / "single")
    r0, r1 = ranks[0]["straight"], ranks[1]["straight"]
    assert r0["steps"] == r1["steps"] == single["steps"] == 8  # ceil(22/6) * 2 epochs
    for k, w in single["weights"].items():
        assert torch.equal(r0["weights"][k], r1["weights"][k]), k  # the ranks stay identical
        _close(r0["weights"][k], w, f"weight {k} after training", atol=2e-5, rtol=1e-4)
    assert r1["logged"] == [] and r1["saved"] == [] and r1["evaluated"] == 0
    assert [s for s, _ in r0["logged"]] == [s for s, _ in single["logged"]]
    for (_, m), (_, ms) in zip(r0["logged"], single["logged"]):
        for k in ("loss", "loss_contrastive", "loss_rtd", "grad_norm"):
            if k in ms:
                assert m[k] == pytest.approx(ms[k], rel=1e-4, abs=1e-6), k
        if "sentences_per_s" in ms:  # throughput counts the global batch
            assert m["sentences_per_s"] > 0
    assert [s for s, _ in r0["saved"]] == [s for s, _ in single["saved"]]
    assert r0["best"][1] == r1["best"][1] == single["best"][1]


@pytest.mark.parametrize("prefix", ["", "cached_"])
def test_distributed_resume_after_kill_equals_uninterrupted(ranks, prefix):
    for r in ranks:
        resumed = r[f"{prefix}resumed"]
        assert resumed["resumed_from"] == 3 and resumed["steps"] == 8
        for k, w in r[f"{prefix}straight"]["weights"].items():
            assert torch.equal(resumed["weights"][k], w), k


# ------------------------------------------------------------------------------------------------ slicing (no processes)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shards_cover_the_global_batch_exactly_in_rank_order(world):
    for n in range(world, 40):
        bounds = [shard_bounds(n, r, world) for r in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))  # contiguous, no gap, no overlap
        sizes = [b - a for a, b in bounds]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_shard_batch_slices_every_field_and_the_aux_batch():
    main = _random_batch(7, 2, 0, True)
    main.rtd_labels = (main.corrupted_ids != main.input_ids).long()
    main.aux = _random_batch(5, 3, 1, False)
    parts = [shard_batch(main, r, 3) for r in range(3)]
    for field in ("input_ids", "attention_mask", "corrupted_ids", "rtd_labels"):
        assert torch.equal(torch.cat([getattr(p, field) for p in parts]), getattr(main, field))
        assert all(getattr(p, field).shape[-1] == 12 for p in parts)  # the global padded length is kept
    assert [p.input_ids.shape[0] for p in parts] == [3, 2, 2]
    assert torch.equal(torch.cat([p.aux.input_ids for p in parts]), main.aux.input_ids)
    assert shard_batch(main, 0, 1) is main


def test_trainer_refuses_a_batch_smaller_than_the_world(monkeypatch):
    from cse.models import distributed
    from cse.storage.training_data import TokenRows
    from cse.training.loop import Trainer
    from cse.training.rows import TrainingRows

    monkeypatch.setattr(distributed, "world", lambda: 4)
    seqs = [np.array([1, 5, 2])] * 9
    rows = TrainingRows(TokenRows(ids=np.arange(9), seqs={"text": seqs}), None, supervised=False, pad_id=0)
    loop = loop_config(batch_size=8, learning_rate=0.1, eval_steps=10, checkpoint_steps=10, deterministic=False)
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):  # 9 rows: the second batch holds 1 row
        Trainer(LocalMean(), rows, loop, torch.device("cpu"), Path("unused"), None, None, None)


# ------------------------------------------------------------------------------------------------ launch
def test_launch_fields_are_validated_and_left_out_of_the_job_identity(monkeypatch):
    from cse.config.training import TrainConfig
    from cse.storage.datasets import DatasetRef
    from cse.tasks.distributed_train import torchrun_command
    from cse.training.job import run_key

    ref = DatasetRef(kind="tokens", key="k", path="p", rows=1, content_hash="h")
    one, two = TrainConfig(), TrainConfig(nproc_per_node=2, nnodes=2)
    assert (one.world_size, one.distributed, two.world_size, two.distributed) == (1, False, 4, True)
    assert run_key(one, ref, None) == run_key(two, ref, None)  # a job may resume on another number of GPUs
    with pytest.raises(ValueError, match="smaller than the 8 training processes"):
        TrainConfig(nproc_per_node=8, batch_size=4)
    cmd = torchrun_command(TrainConfig(nproc_per_node=2), Path("/runs/x/job.json"), "x")
    standalone = (
        "-m torch.distributed.run --nproc-per-node 2 --standalone -m cse.tasks.distributed_train /runs/x/job.json"
    )
    assert cmd[1:] == standalone.split()
    with pytest.raises(ValueError, match="CSE_RDZV_ENDPOINT"):
        torchrun_command(two, Path("job.json"), "x")
    monkeypatch.setenv("CSE_RDZV_ENDPOINT", "node0:29400")
    cmd = torchrun_command(two, Path("job.json"), "runkey")
    rdzv = "--nproc-per-node 2 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id runkey"
    assert cmd[3:13] == rdzv.split()


@pytest.mark.slow
def test_train_task_runs_torchrun_and_rank0_logs_into_the_job_run(
    prefect_harness, tiny_bert_dir, wiki_head, senteval_head
):
    """train-d2cse with nproc_per_node=2 on CPU (gloo): killed, then resumed in the same MLflow run. The data are the
    heads of the shared files (512 Wiki1M lines, every SentEval file cut to 24 lines): the corruption stage corrupts
    all of the corpus, and the dev evaluations need only a few pairs to log a score."""
    import mlflow

    from cse.flows.train import train_d2cse
    from cse.models.checkpoint import load_checkpoint
    from cse.tracking.store import configure_mlflow
    from cse.training.loop import TrainingInterrupted

    overrides = {
        "backbone": str(tiny_bert_dir),
        "max_steps": 8,
        "eval_steps": 4,
        "max_train_sentences": 256,
        "nproc_per_node": 2,
        "device": "cpu",
        "test_evaluation": False,
        "ingest": heads_ingest(wiki_head, senteval_head),
    }
    with pytest.raises(TrainingInterrupted):
        train_d2cse("smoke", overrides, stop_after=6)
    configure_mlflow()
    runs = mlflow.search_runs(experiment_names=["d2cse"], output_format="list")
    assert [r.info.status for r in runs] == ["KILLED"]
    result = train_d2cse("smoke", overrides)
    assert result.resumed_from == 4 and result.steps == 8 and result.run_id == runs[0].info.run_id
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["world_size"] == "2" and run.data.params["nproc_per_node"] == "2"
    assert run.data.params["trainable_parameters"] and run.data.params["resolved_device"] == "cpu"
    assert {h.step for h in client.get_metric_history(result.run_id, "dev/stsb_dev")} == {4, 8}
    assert 8 in {h.step for h in client.get_metric_history(result.run_id, "loss/loss")}
    assert np.isfinite(run.data.metrics["train_seconds"])
    assert load_checkpoint(result.best_checkpoint).method == "d2cse"
