"""Warm-up paid once per node: torch.compile's persistent caches live in `$CSE_HOME/compile-cache` (or
`TORCHINDUCTOR_CACHE_DIR`), and a second process training the same step loads its graphs from there instead of
generating them (training/process.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from cse.storage.settings import REPO_ROOT, compile_cache_dir

# A fresh process: the trainer with the step and the update compiled by inductor, two steps of a toy model; prints
# the cache counters of inductor's FX-graph cache and AOTAutograd's cache, and the folder torch used.
SCRIPT = textwrap.dedent(
    """
    import json, os, time
    import torch
    from torch._dynamo.utils import counters
    from tests.loops import cpu_trainer
    from tests.reliability.conftest import eight_rows_and_loop
    from tests.reliability.test_interrupts_and_precision import _Square
    from dataclasses import replace

    rows, loop = eight_rows_and_loop(0.1)
    loop = replace(loop, compile=True, compile_backend="inductor", max_steps=2, epochs=1)
    t0 = time.perf_counter()
    trainer = cpu_trainer(_Square(), rows, loop, {state!r})
    trainer.run()
    print(json.dumps({{
        "seconds": time.perf_counter() - t0,
        "compiled": trainer.compiled and trainer.in_graph_update is not None,
        "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "fxgraph": dict(counters["inductor"]),
        "aot": dict(counters["aot_autograd"]),
    }}))
    """
)


def _run(tmp_path, n: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR" and not k.endswith("_CACHE")}
    env.update(CSE_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO_ROOT))
    script = SCRIPT.format(state=str(tmp_path / f"state{n}"))
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_compiling_the_same_step_loads_it_from_the_node_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("CSE_HOME", str(tmp_path / "home"))
    folder = compile_cache_dir()
    assert folder == (tmp_path / "home" / "compile-cache").resolve()
    first, second = _run(tmp_path, 1), _run(tmp_path, 2)
    for run in (first, second):
        assert run["compiled"] and run["cache_dir"] == str(folder)
    # the first generates and saves the graphs (the step's forward and backward, the update), the second loads them
    assert first["fxgraph"].get("fxgraph_cache_miss", 0) >= 3 and not first["fxgraph"].get("fxgraph_cache_hit")
    assert first["aot"].get("autograd_cache_saved", 0) >= 2
    assert second["fxgraph"].get("fxgraph_cache_hit", 0) == first["fxgraph"]["fxgraph_cache_miss"]
    assert not second["fxgraph"].get("fxgraph_cache_miss")
    assert second["aot"].get("autograd_cache_hit", 0) == first["aot"]["autograd_cache_saved"]
    assert any((folder / "fxgraph").iterdir()) and second["seconds"] < first["seconds"]
