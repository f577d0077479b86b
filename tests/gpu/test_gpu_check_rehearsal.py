"""`make gpu-check DEVICE=cpu`: `python -m benchmarks.gpu_check` end to end on CPU (the gpu tier at tiny size, then
every method's throughput, corruption and evaluation measurements at tiny size), so the GPU command cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys

from cse.storage.settings import REPO_ROOT


def _rehearse(module: str, out, *args: str) -> None:
    """`python -m benchmarks.<module> --device cpu --out <out> <args>` from the checkout root; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--device", "cpu", "--out", str(out), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def test_gpu_check_rehearsal_on_cpu(tmp_path):
    _rehearse("gpu_check", tmp_path)
    result = json.loads((tmp_path / "gpu_check-cpu.json").read_text())
    assert result["tests"]["returncode"] == 0 and "passed" in result["tests"]["summary"]
    assert "failed" not in result["tests"]["summary"] and "skipped" not in result["tests"]["summary"]
    assert [r["method"] for r in result["training"]] == ["d2cse", "simcse", "dcpcse", "diffcse", "diffaug"]
    for r in result["training"]:
        assert r["steps_per_s"] > 0 and r["tokens_per_s"] > 0 and r["flops_per_step"] > 0, r
        assert 0 <= r["host_wait_share"] < 1 and r["projected_schedule_steps"] > 0 and r["mfu"] is None
    assert result["corruption"]["sentences_per_s"] > 0 and result["corruption"]["wiki1m_faithful_minutes"] > 0
    assert result["evaluation"]["sts7_sentences"] == 2 * 18_850 and result["evaluation"]["sts7_wall_s"] > 0
    md = (tmp_path / "gpu_check-cpu.md").read_text()
    assert "| d2cse |" in md and "seven-task STS" in md


def test_step_profile_rehearsal_on_cpu(tmp_path):
    """benchmarks/step_profile.py end to end on CPU at tiny size (no device timeline there), and its kernel table's
    grouping by name."""
    from types import SimpleNamespace

    from benchmarks.step_profile import _top_kernels, main

    assert main(["--device", "cpu", "--method", "simcse", "--steps", "1", "--warmup", "1", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "step_profile-simcse-cpu.json").read_text())
    assert rec["step_wall_ms"] > 0 and rec["batch_size"] == 4 and rec["max_length"] == 16
    assert rec["gpu_busy_share"] is None and rec["top_device"] == [] and rec["top_host"]
    assert all(r["ms_per_step"] >= 0 and r["calls"] >= 1 for r in rec["top_host"])
    kernels = [SimpleNamespace(name=n, device_time=t) for n, t in (("gemm", 300.0), ("cast", 50.0), ("gemm", 100.0))]
    assert _top_kernels(kernels, steps=2, top=5) == [
        {"name": "gemm", "ms_per_step": 0.2, "calls": 2},
        {"name": "cast", "ms_per_step": 0.025, "calls": 1},
    ]


def test_gpu_speed_rehearsal_on_cpu(tmp_path):
    """`make gpu-speed DEVICE=cpu`: benchmarks/gpu_speed.py end to end on CPU (one method in its three modes on the real
    Wiki1M rows, the compiled mode's warm-up first and cached, the run's state and evaluation overhead on the real
    STS-B dev sentences in three precisions, the evaluation-precision check on the seven STS tasks, the
    sentence-transformers peer eager and compiled); `make gpu-speed` runs every method."""
    _rehearse("gpu_speed", tmp_path, "--methods", "simcse")
    result = json.loads((tmp_path / "gpu_speed-cpu.json").read_text())
    assert [(r["method"], r["mode"]) for r in result["rows"]] == [
        ("simcse", "reference"),
        ("simcse", "eager"),
        ("simcse", "compiled"),
    ]
    for r in result["rows"]:
        assert r["ms_per_step"] > 0 and r["flops_per_step"] > 0 and r["host_ops_per_step_cpu"] > 0, r
        assert 0 < r["real_tokens_per_s"] < r["computed_tokens_per_s"] and 0.5 < r["real_token_share"] < 1, r
    compiled = result["rows"][-1]
    assert compiled["graph_calls_per_step_cpu"] == 2 and compiled["warmup_cached_s"] > 0  # the step and the update
    run = result["runs"]["simcse"]
    assert run["state"]["state_mib"] > 0 and run["evaluation"]["dev_sentences"] == 64
    assert all(run["evaluation"][p]["eval_s"] > 0 for p in ("fp32", "tf32", "bf16"))
    projected = run["projected"]
    assert projected["steps"] == 15_625 and 0 < projected["overhead_share"] < 1
    assert projected["total_min_with_warmup_first"] > projected["total_min"]
    check = result["eval_precision"]
    assert set(check["scores"]) == {"fp32", "tf32", "bf16"} and len(check["scores"]["fp32"]) == 7
    assert check["max_move"]["tf32"] == 0 and "tf32" in check["acceptable"]  # (TF32 does nothing on a CPU)
    assert [p["compiled"] for p in result["peers"]] == [False, True] and all(
        p["ms_per_step"] > 0 for p in result["peers"]
    )
    md = (tmp_path / "gpu_speed-cpu.md").read_text()
    assert "| simcse | compiled |" in md and "like with like" in md and "compilation, not code" in md
