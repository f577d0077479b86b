"""The speed switches change nothing but speed (docs/gpu.md), proven on CPU on tiny models.

The checks:

- every method's whole training step (and each D2CSE ablation, DCPCSE with MLM, both DiffAug phases) compiles as one
  graph with `fullgraph=True`, and the compiled step's loss and gradients equal the eager step's (dropout 0);
- padding every batch to max_length gives the loss and gradients of padding to the longest row;
- the bf16 copies of the frozen weights give bit-identical losses and gradients to autocast's own casts;
- the non-finite guard on the device: a poisoned batch fails the run naming its step, and no later update moves a
  weight (eager, and with the update in the compiled graph);
- the in-graph update (clipping, guard and AdamW as one graph, training/update.py) equals the eager clipping and fused
  AdamW, as one graph across a changing learning rate;
- asynchronous resume states: a kill during a write leaves the previous state loadable, and the resumed run ends
  with the weights of an uninterrupted one.

The compiled steps use dynamo's `aot_eager` backend: the same graph capture and AOTAutograd forward/backward split as
inductor, without its code generation (minutes of C++ compiles on two cores); the GPU check compiles with inductor
and CUDA graphs (benchmarks/gpu_speed.py).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import PretrainedConfig

from benchmarks.gpu_check import build_model, preset, synthetic_rows, synthetic_tokenizer
from cse.models.method import set_backbone_dropout
from cse.training.loop import LoopConfig, NonFiniteLoss, Trainer, TrainerHooks
from cse.training.precision import FrozenLinearCast
from cse.training.rows import TrainingRows
from cse.training.update import InGraphUpdate, linear_decay
from tests.loops import loop_config
from tests.tolerance import assert_close_scaled

BATCH, LENGTH = 4, 12

# (method, model overrides, phase): every method, the D2CSE ablations, DCPCSE's MLM auxiliary, both DiffAug phases
CASES = {
    "simcse": ("simcse", {}, "main"),
    "d2cse": ("d2cse", {}, "main"),
    "d2cse-cls-prompt": ("d2cse", {"cls_prompt": True}, "main"),
    "d2cse-ablation-a": ("d2cse", {"discriminator_prompts": False}, "main"),
    "d2cse-ablation-b": ("d2cse", {"discriminator_prompts": False, "train_discriminator": True}, "main"),
    "d2cse-ablation-c": ("d2cse", {"condition_discriminator": False}, "main"),
    "dcpcse-mlm": ("dcpcse", {"mlm": True}, "main"),
    "diffcse": ("diffcse", {}, "main"),
    "diffaug-prefix": ("diffaug", {}, "prefix"),
    "diffaug-joint": ("diffaug", {}, "joint"),
}


@pytest.fixture(scope="module")
def tok():
    return synthetic_tokenizer()


def _case(name: str, tok, pad_to: int | None = LENGTH):
    """(model without dropout, its host batch, phase) of a case, on a tiny random BERT."""
    method, overrides, phase = CASES[name]
    cfg = preset(method, "tiny", BATCH, LENGTH)
    cfg = cfg.model_copy(update={"model": dataclasses.replace(cfg.model, **overrides)})
    model = build_model(method, cfg, "tiny", tok, seed=0, layers=1)  # (one layer: dynamo traces it in seconds)
    _no_dropout(model)
    rows, nli = synthetic_rows(cfg, method, 2 * BATCH, tok, seed=1)
    rows.pad_to = pad_to
    if phase == "prefix":
        batch = nli.batch(np.arange(BATCH), 0)
    else:
        batch = rows.batch(np.arange(BATCH), 0)
        if cfg.aux_nli_batch_size:
            nli.pad_to = pad_to
            batch.aux = nli.batch(np.arange(cfg.aux_nli_batch_size), 0)
    return model.train(), batch, phase


def _no_dropout(model) -> None:
    """Every dropout of the model off: the encoders' (backbone, discriminator copies) and every `nn.Dropout`."""
    for m in model.modules():
        if isinstance(getattr(m, "config", None), PretrainedConfig):
            set_backbone_dropout(m, 0.0)
        elif isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, fn, batch, phase, step=3):
    torch.manual_seed(11)  # (DCPCSE's MLM masking draws random numbers: the same in both)
    out = fn(batch, step=step, phase=phase)
    out.loss.backward()
    return out.loss.detach(), _grads(model)


@pytest.mark.parametrize("name", list(CASES))
def test_the_whole_step_compiles_as_one_graph_equal_to_eager(name, tok):
    model, batch, phase = _case(name, tok)
    twin = copy.deepcopy(model)
    loss, grads = _step(model, model.training_step, batch, phase)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(twin.training_step, fullgraph=True, backend=counter)
    got_loss, got_grads = _step(twin, compiled, batch, phase, step=torch.tensor(3))  # (the trainer's step tensor)
    assert counter.frame_count == 1  # one graph, and fullgraph=True made any break an error
    assert got_grads.keys() == grads.keys() and grads
    _assert_close(got_loss, got_grads, loss, grads)


def _assert_close(got_loss, got_grads, loss, grads) -> None:
    """The loss, and every gradient on the scale of the largest, equal within float tolerance."""
    assert_close_scaled(got_loss, loss, terms=BATCH * LENGTH)
    scale = max(float(g.abs().max()) for g in grads.values())
    for n, g in grads.items():
        assert_close_scaled(got_grads[n], g, terms=BATCH * LENGTH, scale=scale, msg=n)


@pytest.mark.parametrize("name", ["simcse", "d2cse", "dcpcse-mlm", "diffcse", "diffaug-prefix", "diffaug-joint"])
def test_padding_to_max_length_gives_the_loss_and_gradients_of_padding_to_the_longest_row(name, tok):
    """Rows of 5 to 9 tokens: padded to their longest (9, the references' collators) and to max_length (12).
    DCPCSE's MLM masking draws its random numbers over the padded shape, so it runs here without MLM: with fixed
    padding it masks with the same distribution, in another draw (docs/gpu.md)."""
    if name == "dcpcse-mlm":
        name = "dcpcse-plain"
        CASES[name] = ("dcpcse", {"mlm": False}, "main")
    model, batch, phase = _case(name, tok, pad_to=None)
    short = _shorten(batch)
    wide = _pad(short, LENGTH)
    assert short.input_ids.shape[-1] == 9 and wide.input_ids.shape[-1] == LENGTH
    twin = copy.deepcopy(model)
    loss, grads = _step(model, model.training_step, short, phase)
    _assert_close(*_step(twin, twin.training_step, wide, phase), loss, grads)


def _shorten(batch):
    """Rows cut to 5…9 tokens (still [CLS] … [SEP]), padded to the longest (9)."""
    out = copy.deepcopy(batch)
    parts = [p for p in (out, out.aux) if p is not None]
    for p in parts:
        rows = p.input_ids.shape[0]
        lengths = torch.tensor([9, 5, 7, 6, 8, 9, 5, 7][:rows])
        keep = torch.arange(p.input_ids.shape[-1])[None, None, :] < lengths[:, None, None]
        sep = p.input_ids[..., -1:].expand_as(p.input_ids)
        at_end = torch.arange(p.input_ids.shape[-1])[None, None, :] == (lengths[:, None, None] - 1)
        for name in ("input_ids", "corrupted_ids"):
            t = getattr(p, name)
            if t is not None:
                t = torch.where(at_end, sep, t)
                setattr(p, name, torch.where(keep, t, torch.zeros_like(t))[..., :9].contiguous())
        p.attention_mask = keep.expand_as(p.attention_mask).long()[..., :9].contiguous()
        if p.rtd_labels is not None:
            p.rtd_labels = ((p.corrupted_ids != p.input_ids) & p.attention_mask.bool()).to(p.rtd_labels.dtype)
    return out


def _pad(batch, length):
    out = copy.deepcopy(batch)
    for p in (out, out.aux):
        if p is None:
            continue
        extra = length - p.input_ids.shape[-1]
        for name in ("input_ids", "attention_mask", "corrupted_ids", "rtd_labels"):
            t = getattr(p, name)
            if t is not None:
                setattr(p, name, torch.nn.functional.pad(t, (0, extra)))
    return out


@pytest.mark.parametrize("name", ["d2cse", "dcpcse-mlm", "d2cse-ablation-a"])
def test_frozen_weights_cast_once_are_bit_identical_to_autocast(name, tok):
    model, batch, phase = _case(name, tok)
    twin = copy.deepcopy(model)
    cast = FrozenLinearCast(twin, torch.bfloat16)
    assert len(cast) > 10  # the frozen PLM's Linears
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = _step(model, model.training_step, batch, phase)
        cast.low()
        got_loss, got_grads = _step(twin, twin.training_step, batch, phase)
        cast.master()
    assert torch.equal(got_loss, loss)
    assert got_grads.keys() == grads.keys()
    for n, g in grads.items():
        assert torch.equal(got_grads[n], g), n
    assert all(p.dtype == torch.float32 for p in twin.parameters())  # the masters are back


# ------------------------------------------------------------------------------------------------ the trainer


def _rows(tok) -> TrainingRows:
    cfg = preset("simcse", "tiny", BATCH, LENGTH)
    rows, _ = synthetic_rows(cfg, "simcse", 8 * BATCH, tok, seed=2)
    rows.pad_to = LENGTH
    return rows


def _loop(**kw) -> LoopConfig:
    base = {"batch_size": BATCH, "learning_rate": 1e-3, "seed": 3, "eval_steps": 10**6, "checkpoint_steps": 2}
    return loop_config(**{**base, "log_steps": 4, **kw})


def _simcse(tok):
    cfg = preset("simcse", "tiny", BATCH, LENGTH)
    return build_model("simcse", cfg, "tiny", tok, seed=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "in-graph-update"])
def test_a_non_finite_step_fails_the_run_at_the_next_check_and_no_later_update_moves_a_weight(compiled, tok, tmp_path):
    model = _simcse(tok)
    rows = _rows(tok)
    loop = _loop(checkpoint_steps=10**6, compile=compiled, compile_backend="aot_eager")
    trainer = Trainer(model, rows, loop, torch.device("cpu"), tmp_path / "s", *_callbacks())
    assert trainer.guard is not None and trainer.fused_adamw  # the deferred check is the CPU default too
    assert (trainer.in_graph_update is not None) == compiled
    snapshots = {}
    poison_step = 2  # 1-based: the second step's forward sees a NaN weight

    class Poison(TrainerHooks):  # the second step's forward reads a NaN embedding row: its loss is NaN
        def on_forward_start(self, trainer, batch):
            if trainer.step + 1 == poison_step:
                self.saved = model.backbone.embeddings.word_embeddings.weight.detach().clone()
                model.backbone.embeddings.word_embeddings.weight.data[batch.input_ids[0, 0, 1]] = float("nan")

        def on_forward_end(self, trainer, batch):
            if trainer.step + 1 == poison_step:  # the weight is clean again; only this step's loss is NaN
                model.backbone.embeddings.word_embeddings.weight.data.copy_(self.saved)

        def on_step_end(self, trainer, batch, metrics):
            snapshots[trainer.step] = {n: p.detach().clone() for n, p in model.named_parameters()}

    trainer.hooks.append(Poison())
    with pytest.raises(NonFiniteLoss, match=r"step 2 of \d+ \(phase 'main'\): the loss is nan") as err:
        trainer.run()
    assert "later step(s) before this check ran with their updates skipped" in str(err.value)
    assert trainer.step == 4  # the check ran at the first log step (log_steps = 4)
    for step in (2, 3):  # no update after step 1
        for n, p in snapshots[step].items():
            assert torch.equal(p, snapshots[1][n]), (step, n)
    state = next(iter(trainer.optimizer.state.values()))
    assert int(state["step"]) == 1  # Adam's step count too
    assert not any(torch.isnan(p).any() for p in model.parameters())


def _callbacks():
    return (lambda *a: None, lambda m: 0.0, lambda *a: None)


def _two_groups(seed: int, decay: float):
    """Parameters in two AdamW groups (the second with its own rate and weight decay), a fused AdamW over them and the
    trainer's linear decay over 10 steps."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    groups = [{"params": params[:1]}, {"params": params[1:], "lr": 2e-3, "weight_decay": decay}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    return params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: linear_decay(s, 10))


def _guard_tensors(n: int):
    return torch.zeros(()), torch.full((), -1, dtype=torch.long), torch.full((n,), float("nan"))


def test_the_in_graph_update_equals_eager_clipping_and_fused_adamw_as_one_graph():
    """Clipping (norm above and below the threshold), AdamW with and without weight decay, four steps of a decaying
    learning rate: the parameters, Adam's moments and step counts equal the eager update's within the scale rule, and
    the update is one graph for every step (the rate reaches it from the step tensor, not as a constant)."""
    eager, opt, sched = _two_groups(0, decay=0.01)
    mine, opt2, sched2 = _two_groups(0, decay=0.01)
    counter = CompileCounterWithBackend("aot_eager")
    update = InGraphUpdate(opt2, 1.0, offset=0, horizon=10, backend=counter)
    guard, step = _guard_tensors(2), torch.zeros((), dtype=torch.long)
    for k, size in enumerate((3.0, 0.01, 2.0, 0.02)):
        grads = [size * torch.randn_like(p) for p in eager]
        for ps in (eager, mine):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_(eager, 1.0)
        opt.step()
        sched.step()
        step.fill_(k)
        values = update([torch.tensor(0.5)], step, guard)
        sched2.step()
        assert_close_scaled(values, torch.stack([torch.tensor(0.5), norm]))
    assert counter.frame_count == 1  # fullgraph: one graph, no recompilation as the rate decays
    assert float(guard[0]) == 0 and int(guard[1]) == -1
    for a, b in zip(eager, mine):
        assert_close_scaled(b.detach(), a.detach(), terms=4)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert_close_scaled(opt2.state[b][key], opt.state[a][key], terms=4, msg=key)


def test_the_in_graph_guard_turns_a_non_finite_step_and_every_later_one_into_no_update():
    params, opt, _ = _two_groups(1, decay=0.0)
    update = InGraphUpdate(opt, 1.0, offset=0, horizon=10, backend="aot_eager")
    guard, step = _guard_tensors(2), torch.zeros((), dtype=torch.long)
    before = None
    for k in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        if k == 1:
            params[1].grad[2] = float("inf")  # the gradient norm of step 2 (1-based) is not finite
            before = (
                [p.detach().clone() for p in params],
                {key: opt.state[params[0]][key].clone() for key in opt.state[params[0]]},
            )
        step.fill_(k)
        update([torch.tensor(0.25)], step, guard)
    assert float(guard[0]) == 1 and int(guard[1]) == 2 and not torch.isfinite(guard[2][-1])
    for p, b in zip(params, before[0]):
        assert torch.equal(p.detach(), b)
    for key, value in before[1].items():
        assert torch.equal(opt.state[params[0]][key], value), key
    assert float(opt.state[params[0]]["step"]) == 1


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal
    import torch
    torch.set_num_threads({threads})  # the parent's: float sums in the same order, so "exact" can be bit-exact
    from tests.training import test_speed as t
    import cse.training.state_writer as sw

    real = sw.write_state
    def write_then_die(state, snapshot):  # the second write is killed between the atomic swap's two renames
        if snapshot.progress["step"] == 4:
            import cse.storage.atomic as atomic
            replace = atomic.os.replace
            def killed(src, dst):
                if str(dst) == {state!r}:
                    os.kill(os.getpid(), signal.SIGKILL)
                return replace(src, dst)
            atomic.os.replace = killed
        return real(state, snapshot)
    sw.write_state = write_then_die
    tok = t.synthetic_tokenizer()
    trainer = t.Trainer(t._simcse(tok), t._rows(tok), t._loop(), torch.device("cpu"), {state!r}, *t._callbacks())
    trainer.run()
    """
)


def test_a_kill_during_a_background_state_write_leaves_the_previous_state_and_resume_is_exact(tok, tmp_path):
    from cse.storage.settings import REPO_ROOT

    uninterrupted = Trainer(_simcse(tok), _rows(tok), _loop(), torch.device("cpu"), tmp_path / "a", *_callbacks())
    uninterrupted.run()

    state = tmp_path / "b"
    script = KILL_SCRIPT.format(state=str(state), threads=torch.get_num_threads())
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, env=os.environ)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not state.exists() and (tmp_path / "b.previous").is_dir()  # killed between the renames

    model = _simcse(tok)
    resumed = Trainer(model, _rows(tok), _loop(), torch.device("cpu"), state, *_callbacks())
    result = resumed.run()
    assert result.resumed_from == 2  # the previous state (step 2) was put back and loaded
    want = dict(uninterrupted.model.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, want[n]), n


def test_the_trainer_runs_the_compiled_step_and_update_to_the_eager_losses_and_weights(tok, tmp_path):
    """DCPCSE with MLM (its weight reads the step number, which the compiled step gets as a tensor) through
    `Trainer.run` with `compile=True`, the update in the graph too: the three steps' losses, and the weights and Adam
    moments after the first update, equal the eager run's.

    (Not the weights after three steps: without dropout both views are one embedding, so the contrastive gradients
    are cancellations; Adam normalises each entry, so a one-ulp difference of the first update's weights becomes a
    learning-rate-sized difference of the next updates' near-zero entries, whatever computes them.)"""
    cfg = preset("dcpcse", "tiny", BATCH, LENGTH)
    cfg = cfg.model_copy(update={"model": dataclasses.replace(cfg.model, mlm=True)})
    rows, _ = synthetic_rows(cfg, "dcpcse", 3 * BATCH, tok, seed=4)
    rows.pad_to = LENGTH
    runs = []

    class Record(TrainerHooks):
        def __init__(self):
            self.losses, self.first = [], None

        def on_step_end(self, trainer, batch, metrics):
            self.losses.append(metrics["loss"])
            if trainer.step == 1:
                self.first = [p.detach().clone() for p in trainer.params] + [
                    trainer.optimizer.state[p][k].clone() for p in trainer.params for k in ("exp_avg", "exp_avg_sq")
                ]

    for compiled in (False, True):
        model = build_model("dcpcse", cfg, "tiny", tok, seed=0, layers=1)
        _no_dropout(model)
        loop = _loop(compile=compiled, compile_backend="aot_eager", log_steps=1, checkpoint_steps=10**6)
        trainer = Trainer(model, rows, loop, torch.device("cpu"), tmp_path / f"s{compiled}", *_callbacks())
        assert (trainer.in_graph_update is not None) == compiled  # the update in the graph too
        runs.append(Record())
        trainer.hooks.append(runs[-1])
        torch.manual_seed(5)
        trainer.run()
    eager, graph = runs
    assert len(graph.losses) == 3
    assert_close_scaled(torch.tensor(graph.losses), torch.tensor(eager.losses), terms=BATCH * LENGTH)
    for got, want in zip(graph.first, eager.first):
        assert_close_scaled(got, want, terms=BATCH * LENGTH)


def test_the_step_is_compiled_by_default_on_a_gpu_for_runs_long_enough_to_repay_it():
    """`LoopConfig.compile=None` (the job default): compiled on CUDA for a single-process run of ≥ 3,000 steps without
    gradient caching; an explicit value wins."""
    from cse.training.loop import COMPILE_MIN_STEPS

    def decides(device="cuda", steps=COMPILE_MIN_STEPS, world=1, chunk=None, compile=None) -> bool:
        t = object.__new__(Trainer)
        t.cfg, t.device = _loop(compile=compile, grad_cache_chunk_size=chunk), torch.device(device)
        t.world, t.total_steps = world, steps
        return t.compiles()

    assert decides()
    assert not decides(device="cpu") and not decides(steps=COMPILE_MIN_STEPS - 1)  # CPU; a smoke run
    assert not decides(world=2) and not decides(chunk=8)
    assert decides(device="cpu", compile=True) and not decides(compile=False)
