"""The CUDA tier (`pytest -m gpu`; benchmarks/gpu_check.py runs it): every method's training step in bf16 and fp16
(GradScaler) at tiny and BERT-base size, gradient caching under autocast and the GradScaler equal to the same chunks
with their graphs kept, prefix attention through SDPA equal to eager, the evaluator on the device
equal to CPU fp32, corruption on the device, a checkpoint written on the device that loads on CPU and resumes with
the same next-step loss, data parallelism through torchrun with NCCL.

Skipped without a CUDA device (the only skip in the suite), except in the rehearsal (CSE_GPU_CHECK_DEVICE=cpu,
`make gpu-check DEVICE=cpu`, run by make test): then the same tests run on CPU at tiny size, bf16 only, gloo.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from benchmarks.gpu_check import (
    METHODS,
    backbone,
    build_model,
    job_phases,
    loop_config,
    preset,
    synthetic_rows,
    synthetic_tokenizer,
)
from cse.storage.settings import REPO_ROOT
from cse.training.loop import StopAfter, Trainer, TrainingInterrupted

CUDA = torch.cuda.is_available()
REHEARSAL = os.environ.get("CSE_GPU_CHECK_DEVICE") == "cpu"
DEVICE = torch.device("cpu" if REHEARSAL or not CUDA else "cuda")
SIZES = ["tiny"] if DEVICE.type == "cpu" else ["tiny", "base"]
PRECISIONS = ["bf16"] if DEVICE.type == "cpu" else ["bf16", "fp16"]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not CUDA and not REHEARSAL,
        reason=(
            "no CUDA device: the gpu tier runs on a GPU (make gpu-check); make gpu-check DEVICE=cpu rehearses it on CPU"
        ),
    ),
]


@pytest.fixture(scope="module")
def tok():
    return synthetic_tokenizer()


def _trainer(
    method,
    size,
    tok,
    precision,
    steps,
    state: Path,
    batch=4,
    length=16,
    stop_after=None,
    seed=0,
    chunk=None,
    compile=False,
):
    cfg = preset(method, size, batch=batch, length=length)
    torch.manual_seed(seed)
    model = build_model(method, cfg, size, tok, seed=cfg.seed).to(DEVICE)
    rows, nli = synthetic_rows(cfg, method, 2 * max(batch, cfg.prefix_phase.batch_size if cfg.prefix_phase else 0), tok)
    log: list[tuple[int, dict]] = []
    lc = loop_config(cfg, precision, steps)
    lc.checkpoint_steps, lc.deterministic, lc.grad_cache_chunk_size, lc.compile = 1, True, chunk, compile
    # a resume state at every step, on any device: the CUDA default keeps states 50 x their cost apart, so a run
    # stopped at step 2 could resume from step 1 (LoopConfig.state_interval_s)
    lc.state_interval_s = 0.0
    # (the CPU rehearsal traces with dynamo's eager backend: inductor's CPU build alone takes minutes)
    lc.compile_backend = "inductor" if DEVICE.type == "cuda" else "eager"
    trainer = Trainer(
        model,
        job_phases(cfg, rows, nli, steps),
        lc,
        DEVICE,
        state,
        lambda *a: None,
        lambda m: 0.0,
        lambda m, step: "loss" in m and log.append((step, m)),
        hooks=[StopAfter(stop_after)] if stop_after is not None else [],
    )
    return trainer, log


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("method", METHODS)
def test_training_step(method, size, precision, tok, tmp_path):
    # fp16's GradScaler starts at a scale of 2**16 and skips each step whose scaled gradients overflow, halving the
    # scale (as the reference's AMP does; measured on an H100: at tiny size the first two steps of d2cse, dcpcse and
    # diffcse were both skipped), so fp16 gets steps enough for one to land.
    trainer, log = _trainer(
        method,
        size,
        tok,
        precision,
        8 if precision == "fp16" else 2,
        tmp_path / "state",
        batch=8 if size == "base" else 4,
        length=32 if size == "base" else 16,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.run()
    losses = [m["loss"] for _, m in log]
    assert len(losses) == sum(p.max_steps for p in trainer.phases) and all(math.isfinite(x) for x in losses), losses
    moved = [
        n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p.detach(), before[n])
    ]
    landed = [step for step, m in log if math.isfinite(m["grad_norm"])]  # a skipped fp16 step logs an inf norm
    assert landed, f"every step was skipped; GradScaler scale {trainer.scaler.get_scale()}"
    assert moved, "no trainable parameter changed"
    assert trainer.scaler.is_enabled() == (precision == "fp16" and DEVICE.type == "cuda")
    assert 0.0 <= trainer.host_wait_s <= trainer.loop_s


@pytest.mark.parametrize("method", ["d2cse", "simcse"] if DEVICE.type == "cuda" else ["d2cse"])
def test_compiled_step_equals_eager_with_a_graph_for_every_layer(method, tok, tmp_path, monkeypatch):
    """The compiled whole step (one graph, CUDA graphs on a GPU) gives the eager losses (inductor drawing dropout from
    the eager RNG) without reaching dynamo's recompilation limit (which raises here instead of falling back to eager).
    The CPU rehearsal traces with dynamo's eager backend (`_trainer`)."""
    import torch._dynamo
    import torch._inductor.config

    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", torch._dynamo.config.recompile_limit)
    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    size = "base" if DEVICE.type == "cuda" else "tiny"  # base: 12 layers, past the default limit of 8 (tiny has 2)
    losses = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        trainer, log = _trainer(method, size, tok, "fp32", 3, tmp_path / str(compiled), compile=compiled)
        trainer.run()
        losses[compiled] = [m["loss"] for _, m in log]
    torch._dynamo.reset()
    assert len(losses[True]) == 3
    # (inductor's fused fp32 kernels sum in another order: on an H100 d2cse's second loss, 0.0908, differed by 4.9e-5)
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("method", METHODS)
def test_grad_cache_under_autocast_and_the_grad_scaler_equals_the_chunks_with_their_graphs(
    method, precision, tok, tmp_path
):
    """Two steps with cached chunks of 3 rows (fp16: through the GradScaler) end where the same chunks with their
    graphs kept end; the steps' peak memory is logged."""
    from cse.models.grad_cache import RowChunks

    weights = []
    for keep_graph in (True, False):
        trainer, log = _trainer(method, "tiny", tok, precision, 2, tmp_path / f"state{keep_graph}", chunk=3)
        trainer.model.use_grad_cache(RowChunks(3, keep_graph=keep_graph))
        torch.manual_seed(5)
        trainer.run()
        weights.append({n: p.detach().float().cpu() for n, p in trainer.model.named_parameters() if p.requires_grad})
        assert all(m["peak_memory_gb"] > 0 for _, m in log), log
    for n, w in weights[0].items():
        torch.testing.assert_close(weights[1][n], w, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{method} {n}: {m}")


@pytest.mark.parametrize("size", SIZES)
def test_prefix_attention_sdpa_equals_eager(size):
    from cse.models.prompts.backbone import PromptedBackbone
    from cse.models.prompts.prefixes import PrefixEncoder

    sdpa = backbone(size, seed=3, attn="sdpa")
    eager = backbone(size, seed=3, attn="eager")
    eager.load_state_dict(sdpa.state_dict())
    cfg = sdpa.config
    torch.manual_seed(4)
    prefix = PrefixEncoder(8, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, dropout=0.0)
    a = PromptedBackbone(sdpa, prefix).to(DEVICE).eval()
    b = PromptedBackbone(eager, copy.deepcopy(prefix)).to(DEVICE).eval()
    assert a.inner == "sdpa" and b.inner == "eager"
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1000, 30522, (6, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 12:] = mask[4, 5:] = 0
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    ha = a(ids, mask, prefix=True).last_hidden_state
    hb = b(ids, mask, prefix=True).last_hidden_state
    keep = mask.bool()
    torch.testing.assert_close(ha[keep], hb[keep], rtol=1e-4, atol=1e-4)
    ha[keep].square().sum().backward()
    hb[keep].square().sum().backward()
    for (n, pa), (_, pb) in zip(a.prefix_encoder.named_parameters(), b.prefix_encoder.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-3, atol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16), torch.no_grad():
        torch.testing.assert_close(
            a(ids, mask, prefix=True).last_hidden_state[keep].float(),
            b(ids, mask, prefix=True).last_hidden_state[keep].float(),
            rtol=0.05,
            atol=0.05,
        )


def test_evaluator_on_device_equals_cpu_fp32(tok):
    from cse.evaluation.encode import embed_token_ids
    from cse.evaluation.sts import correlation

    size = SIZES[-1]
    cfg = preset("simcse", size)
    model = build_model("simcse", cfg, size, tok)
    rng = np.random.default_rng(0)
    ids = [[101, *rng.integers(1000, 30522, int(rng.integers(4, 30))).tolist(), 102] for _ in range(400)]
    gold = rng.random(200)

    def spearman(m):
        emb = embed_token_ids(m, ids, batch_size=64)[0].double().numpy()
        a, b = emb[0::2], emb[1::2]
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        return correlation(cos, gold).spearman

    on_cpu = spearman(copy.deepcopy(model))
    on_device = spearman(model.to(DEVICE))
    assert abs(on_device - on_cpu) <= 1e-4 * 100, (on_device, on_cpu)  # correlation() reports ×100: 1e-4 Spearman


def test_corruption_on_device():
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    from cse.models.corruption import Corruptor, SpecialTokens

    torch.manual_seed(0)
    gen = DistilBertForMaskedLM(DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=4, hidden_dim=64))
    tokens = SpecialTokens(pad=0, mask=103, special=(0, 100, 101, 102, 103), vocab_size=30522)
    ids = torch.randint(1000, 30522, (16, 24), generator=torch.Generator().manual_seed(1))
    ids[:, 0], ids[:, -1] = 101, 102
    mask = torch.ones_like(ids)
    mask[3, 10:] = 0
    ids[3, 10:] = 0
    cpu = Corruptor(copy.deepcopy(gen), tokens, 0.3, "argmax", device="cpu", bf16=False)
    dev = Corruptor(gen, tokens, 0.3, "argmax", device=DEVICE, bf16=False)
    noise = cpu.draw_noise(ids.shape, torch.Generator().manual_seed(2))
    a, b = cpu(ids, mask, noise=noise), dev(ids, mask, noise=noise)
    assert torch.equal(a.n_masked, b.n_masked) and int(b.n_masked.sum()) > 0
    assert torch.equal(b.labels.bool(), (b.corrupted != ids) & mask.bool())
    assert torch.equal(b.corrupted[:, 0], ids[:, 0]) and torch.equal(b.corrupted[3, 10:], ids[3, 10:])
    agree = (a.corrupted == b.corrupted).float().mean().item()
    assert agree > 0.99, f"argmax corruption on {DEVICE} differs from CPU at {(1 - agree):.1%} of positions"


@pytest.mark.parametrize("method", ["simcse"] if DEVICE.type == "cpu" else ["d2cse", "simcse"])
def test_checkpoint_from_device_loads_on_cpu_and_resumes_with_the_same_next_step_loss(method, tok, tmp_path):
    precision = PRECISIONS[0]
    full, full_log = _trainer(method, "tiny", tok, precision, 4, tmp_path / "full")
    full.run()
    killed, _ = _trainer(method, "tiny", tok, precision, 4, tmp_path / "resumed", stop_after=2)
    with pytest.raises(TrainingInterrupted):
        killed.run()
    cpu_model = build_model(method, preset(method, "tiny", batch=4, length=16), "tiny", tok)
    state = load_file(str(killed.state.trainable))
    assert all(t.device.type == "cpu" for t in state.values())
    missing, unexpected = cpu_model.load_state_dict(state, strict=False)
    assert not unexpected
    resumed, log = _trainer(method, "tiny", tok, precision, 4, tmp_path / "resumed")
    resumed.run()
    assert resumed.step == 4 and log[0][0] == 3
    torch.testing.assert_close(log[0][1]["loss"], dict(full_log)[3]["loss"], rtol=1e-5, atol=1e-6)


def test_data_parallel_through_torchrun(tmp_path):
    world = torch.cuda.device_count() if DEVICE.type == "cuda" else 1
    out = tmp_path / "ddp.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        "-m",
        "tests.gpu.ddp_worker",
        str(out),
        DEVICE.type,
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["world"] == world and got["backend"] == ("nccl" if DEVICE.type == "cuda" else "gloo")
    assert len(got["losses"]) == 2 and all(math.isfinite(x) for x in got["losses"])
