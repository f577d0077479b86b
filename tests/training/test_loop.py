"""The training loop: loss goes down, only trainable tensors move, resume-after-kill is exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cse.models.checkpoint import trainable_state_dict
from cse.models.methods.d2cse import D2CSE, D2CSEModelConfig
from cse.storage.training_data import CorruptionRows, TokenRows
from cse.training.loop import LoopConfig, StopAfter, Trainer, TrainingInterrupted
from cse.training.rows import TrainingRows
from tests.loops import loop_config


@pytest.fixture(scope="module")
def rows(shared_data, tokenizer):
    lines = (shared_data / "wiki1m_head.txt").read_text().splitlines()[:96]
    seqs = [np.asarray(x, dtype=np.int64) for x in tokenizer(lines, truncation=True, max_length=24)["input_ids"]]
    rng = np.random.default_rng(0)
    corrupted, labels = {}, {}
    for v in range(2):
        cs, ls = [], []
        for s in seqs:
            c = s.copy()
            pos = rng.random(len(s)) < 0.3
            pos[0] = pos[-1] = False
            c[pos] = rng.integers(1000, 30000, pos.sum())
            cs.append(c)
            ls.append((c != s).astype(np.int8))
        corrupted[("text", v)], labels[("text", v)] = cs, ls
    tokens = TokenRows(ids=np.arange(len(seqs)), seqs={"text": seqs})
    return TrainingRows(
        tokens,
        CorruptionRows(variants=2, corrupted=corrupted, labels=labels),
        supervised=False,
        pad_id=tokenizer.pad_token_id,
    )


def _model(tiny_bert_dir) -> D2CSE:
    torch.manual_seed(0)
    return D2CSE(D2CSEModelConfig(backbone=str(tiny_bert_dir), prefix_len=4, rtd_weight=0.05))


def _loop(**kw) -> LoopConfig:
    base = {"batch_size": 16, "learning_rate": 0.02, "epochs": 2, "seed": 7, "eval_steps": 4, "checkpoint_steps": 4}
    return loop_config(**{**base, "log_steps": 2, **kw})


class Recorder:
    def __init__(self, probe):
        self.metrics, self.saved, self.probe = [], [], probe

    def log(self, m, step):
        self.metrics.append((step, m))

    def save_best(self, model, step, score):
        self.saved.append((step, score))

    def evaluate(self, model) -> float:
        """A deterministic dev score: mean cosine of two fixed sentences' embeddings (higher is better)."""
        model.eval()
        with torch.no_grad():
            e = model.embed(*self.probe)
        model.train()
        return float(torch.nn.functional.cosine_similarity(e[0:1], e[1:2]))


@pytest.fixture
def probe(rows):
    ids = [rows.tokens.seqs["text"][0], rows.tokens.seqs["text"][0]]
    from cse.models.batching import pad_sequences

    return pad_sequences(ids, rows.pad_id)


def _trainer(model, rows, tmp_path, rec, stop_after=None, **kw):
    return Trainer(
        model,
        rows,
        _loop(**kw),
        torch.device("cpu"),
        tmp_path / "state",
        rec.save_best,
        rec.evaluate,
        rec.log,
        hooks=[StopAfter(stop_after)] if stop_after is not None else [],
    )


def test_views_read_their_own_corruption_variant(rows):
    b0 = rows.batch(np.arange(4), epoch=0)
    assert b0.input_ids.shape[:2] == (4, 2)
    assert torch.equal(b0.input_ids[:, 0], b0.input_ids[:, 1])  # the same sentence twice
    assert not torch.equal(b0.corrupted_ids[:, 0], b0.corrupted_ids[:, 1])  # variants 0 and 1
    assert torch.equal(b0.rtd_labels.bool(), (b0.corrupted_ids != b0.input_ids) & b0.attention_mask.bool())
    assert rows.reuse_description(epochs=1) == "fresh corruption for every view of every epoch"


def test_training_moves_only_trainable_tensors_and_selects_best(rows, tiny_bert_dir, tmp_path, probe):
    model = _model(tiny_bert_dir)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = {k: v.clone() for k, v in trainable_state_dict(model).items()}
    rec = Recorder(probe)
    result = _trainer(model, rows, tmp_path, rec).run()
    assert result.steps == 12  # ceil(96/16) * 2 epochs
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    after = trainable_state_dict(model)
    assert any(not torch.equal(after[k], before[k]) for k in before if "prefix" in k)
    losses = [m["loss"] for _, m in rec.metrics if "loss" in m]
    assert len(losses) == 6 and np.mean(losses[-2:]) < np.mean(losses[:2])
    devs = [m["stsb_dev"] for _, m in rec.metrics if "stsb_dev" in m]
    assert len(devs) == 3 and [s for _, s in rec.saved] == sorted(s for _, s in rec.saved)
    assert result.best_score == max(devs)
    lrs = [m["learning_rate"] for _, m in rec.metrics if "learning_rate" in m]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] == 0.0  # linear decay to 0, no warm-up


def test_resume_after_kill_equals_uninterrupted(rows, tiny_bert_dir, tmp_path, probe):
    straight = _model(tiny_bert_dir)
    _trainer(straight, rows, tmp_path / "a", Recorder(probe)).run()

    killed = _model(tiny_bert_dir)
    with pytest.raises(TrainingInterrupted):
        _trainer(killed, rows, tmp_path / "b", Recorder(probe), stop_after=6).run()
    resumed = _model(tiny_bert_dir)  # a fresh process: new model, state read from disk
    rec = Recorder(probe)
    result = _trainer(resumed, rows, tmp_path / "b", rec).run()
    assert result.resumed_from == 4 and result.steps == 12
    a, b = trainable_state_dict(straight), trainable_state_dict(resumed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_state_of_another_schedule_is_refused(rows, tiny_bert_dir, tmp_path, probe):
    with pytest.raises(TrainingInterrupted):
        _trainer(_model(tiny_bert_dir), rows, tmp_path, Recorder(probe), stop_after=4).run()
    with pytest.raises(ValueError, match="another data size or schedule"):
        _trainer(_model(tiny_bert_dir), rows, tmp_path, Recorder(probe), batch_size=8).run()


def test_hooks_see_every_phase_step_forward_and_update_in_order_and_save_state_off_writes_nothing(tmp_path):
    from cse.training.loop import TrainerHooks
    from tests.training.test_resume_state import _trainer as weighted_trainer

    class Seen(TrainerHooks):
        def __init__(self):
            self.events = []

        def on_phase_start(self, trainer):
            self.events.append(("phase", trainer.phase.name))

        def on_step_start(self, trainer, batch):
            self.events.append(("step", trainer.step))

        def on_forward_start(self, trainer, batch):
            self.events.append("forward")

        def on_forward_end(self, trainer, batch):
            self.events.append("/forward")

        def on_update_start(self, trainer):
            self.events.append("update")

        def on_update_end(self, trainer):
            self.events.append("/update")

        def on_step_end(self, trainer, batch, metrics):
            self.events.append(("end", trainer.step, sorted(metrics)[:2]))

    seen = Seen()
    trainer = weighted_trainer(tmp_path / "state", hooks=[seen], save_state=False)
    trainer.run()
    per_step = lambda s: [("step", s), "forward", "/forward", "update", "/update"]
    assert seen.events[:7] == [("phase", "main")] + per_step(0) + [("end", 1, ["epoch", "grad_norm"])]
    assert [e for e in seen.events if e[0] == "end"] == [("end", s, ["epoch", "grad_norm"]) for s in (1, 2, 3, 4)]
    assert not trainer.state.exists() and not (tmp_path / "state").exists()
    # the public pieces run() is made of: the host batch of a step, one optimiser step (a fresh trainer: the LR of
    # the finished one has decayed to 0)
    trainer = weighted_trainer(tmp_path / "fresh")
    batch, epoch, index, sentences, _ = trainer.batch_at(1)
    assert (epoch, index, sentences) == (0, 1, 8)  # 4 rows x 2 dropout views
    before = trainer.model.w.detach().clone()
    metrics = trainer.train_step(batch.to(trainer.device))
    assert set(metrics) == {"loss", "grad_norm"} and not torch.equal(before, trainer.model.w.detach())
