"""`cse run` follows its flow run as `trainer.train()` would in a notebook: a live line per stage, a progress bar of the
training steps, and at the end the result with its links.

While the run goes on, every poll reads (nothing is read from the worker's processes or files):
- the task runs of the flow run and of its child flow runs (Prefect's API): a line when a stage ends (its state and
  duration), and one when a stage still runs after `ANNOUNCE_AFTER_S` seconds; a task run once per shard
  (`SHARDS`) is counted on one line, `corrupt-shard: 3 of 8 completed`;
- the new log lines of those runs that say whether a stage reused its result or wrote it (`cache hit`, `written`, the
  lines `STAGE_LINE` matches), as they arrive;
- the log lines of the evaluations' progress (`EVAL_LINE`: sentences embedded of all, sentences/s, ETA), as the bar's
  line; the shard totals the stages log (`SHARD_TOTAL`), the fixed denominator of the count lines; the warnings
  (level WARNING and above, first line) the stages log, kept for the summary;
- the MLflow training run the flow run made (`cse.tracking.progress`): its last logged step of `total_steps`, loss
  and STS-B dev score, from the metrics the loop logs every `log_steps`; the bar and its ETA (from the pace between the
  logged steps' timestamps) are drawn by tqdm's own `format_meter`.

When the run has ended, `summary` prints, for each MLflow run it made that has scores (training runs, evaluations,
comparisons), and each finished job a cache-hit rerun returned (`REUSED_RUN`: it makes no MLflow run of its own), its
STS table beside the backbone before training and the paper's row, and its id, page and job folder, after the Prefect
flow run's page; then the warnings the stages logged.

On a terminal the bar is redrawn in place (and never drawn again once a line followed it, unless it changed); into a
pipe or a file each new step (or new dev score) is a new line.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from uuid import UUID

from cse.storage.secrets import redact

ANNOUNCE_AFTER_S = 5.0  # a stage still running after this long gets a line (long stages show up; quick ones once)
GROUP_EVERY_S = 10.0  # a shard task's count line at most this often (and when all are done)
SHARDS = "-shard"  # the tasks run once per shard (tokenize-shard, corrupt-shard): counted on one line
MLFLOW_SEARCH_EVERY_S = 5.0  # how often the MLflow store is searched for the flow run's training runs
_SUFFIX = re.compile(r"-[0-9a-f]{3}$")  # Prefect's task run names: `<task name>-<3 hex digits>`
# The stages' own words for a reused or fresh result (tasks/*.py, flows/*.py log them)
STAGE_LINE = re.compile(r"\b(cache hit|written|already finished)\b")
# A finished job returned by a rerun: `job <folder> already finished (MLflow run <id>)` (flows/train.py)
REUSED_RUN = re.compile(r"already finished \(MLflow run ([0-9a-f]{32})\)")
# An evaluation's progress (cse.tasks.log.embedding_progress) and a sharded stage's number of shards
EVAL_LINE = re.compile(r"^[a-z-]+: [\d,]+ of [\d,]+ sentences embedded\b")
SHARD_TOTAL = re.compile(r"^([a-z-]+-shard): (\d+) shards$")
WARNING = 30  # the log level from which a stage's line is a warning the summary repeats


def reused_runs(lines: list[str]) -> list[str]:
    """The MLflow run ids of the finished jobs that stage lines say were returned as they were (`REUSED_RUN`)."""
    return [m.group(1) for line in lines if (m := REUSED_RUN.search(line))]


def task_name(run_name: str) -> str:
    """A task run's task name (`fit-3a1` → `fit`)."""
    return _SUFFIX.sub("", run_name)


async def flow_run_tree(client, flow_run_id: UUID) -> tuple[list[UUID], set[UUID]]:
    """The flow run and its child flow runs at every depth (the flow run first), and the task runs that stand for the
    children in their parents."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    ids, frontier, stand_ins = [flow_run_id], [flow_run_id], set()
    while frontier:
        children = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=frontier))
        )
        stand_ins |= {c.parent_task_run_id for c in children}
        frontier = [c.id for c in children if c.id not in ids]
        ids += frontier
    return ids, stand_ins


class Printer:
    """Where `cse run` writes: whole lines, and one bar line that a terminal redraws in place (`tty`) and a pipe
    gets as a new line whenever its `key` (the step) changes."""

    def __init__(self, out: Callable[[str], None], tty: bool = False, stream=None):
        self.out, self.tty, self.stream = out, tty, stream or sys.stdout
        self._bar_open = False
        self._bar_key: object = None

    def line(self, text: str) -> None:
        self.close()
        self.out(text)

    def bar(self, text: str, key: object) -> None:
        if self.tty and not self._bar_open and key == self._bar_key:
            return  # a line followed it and it has not changed: not drawn again (its clock would run on)
        if self.tty:
            self.stream.write("\r" + text + "\x1b[K")
            self.stream.flush()
            self._bar_open = True
        elif key != self._bar_key:
            self.out(text)
        self._bar_key = key

    def close(self) -> None:
        if self._bar_open:
            self.stream.write("\n")
            self.stream.flush()
            self._bar_open = False


def progress_bar(p, tty: bool) -> str:
    """The training line: `train  50%|#####     | 20/40 [00:30<00:30, 1.50s/step, loss=3.2100, dev=71.23]` (tqdm's
    `format_meter`; the rate and ETA from the pace between logged steps)."""
    from tqdm import tqdm

    postfix = (f"loss={p.loss:.4f}, " if p.loss is not None else "") + (
        f"dev={p.dev:.2f}" if p.dev is not None else "dev=–"
    )
    rate = 1.0 / p.seconds_per_step if p.seconds_per_step else None
    text = tqdm.format_meter(
        p.step,
        p.total,
        p.elapsed_s,
        ncols=100 if tty else 90,
        prefix="    train",
        ascii=not tty,
        unit="step",
        rate=rate,
        postfix=postfix,
    )
    if p.total is not None and rate is not None:
        text += f"  ETA {timedelta(seconds=round(p.eta_s or 0))}"
    return text


@dataclass
class Follower:
    """The state of one followed flow run between polls."""

    flow_run_id: UUID
    printer: Printer
    began: float = field(default_factory=time.monotonic)
    flow_runs: list[UUID] = field(default_factory=list)
    _states: dict[UUID, str] = field(default_factory=dict)
    _announced: set[UUID] = field(default_factory=set)
    _groups: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # name → (done, total, printed at)
    _logs_after: datetime | None = None
    _seen_logs: set[UUID] = field(default_factory=set)
    _training: list[str] = field(default_factory=list)  # MLflow training run ids
    _subflow_tasks: set[UUID] = field(default_factory=set)  # task runs that stand for a child flow run
    _searched_at: float = -1e9
    _shard_totals: dict[str, int] = field(default_factory=dict)  # `corrupt-shard` → how many shards its stage plans
    stage_texts: list[str] = field(default_factory=list)  # the stage lines seen (their reused runs: `reused_runs`)
    warnings: list[str] = field(default_factory=list)  # the warnings the stages logged, first line each, once
    _drawn: dict[str, object] = field(default_factory=dict)  # each bar's (training run's, evaluation's) last key

    def stamp(self) -> str:
        return f"    {time.monotonic() - self.began:6.0f} s  "

    def _bar(self, source: str, text: str, key: object) -> None:
        """Draw the bar of `source` (a training run, an evaluation) when its `key` changed since it was last drawn:
        a finished bar is never drawn again after the lines that followed it."""
        if self._drawn.get(source) != key:
            self._drawn[source] = key
            self.printer.bar(text, key=(source, key))

    async def poll(self, client, final: bool = False) -> None:
        """Read what changed since the last poll and print it (`final`: the run has ended; every count line is
        printed now)."""
        await self._tree(client)
        await self._log_lines(client)  # (first: the shard totals they name are the count lines' denominators)
        await self._task_lines(client, final)
        self._progress(final)

    async def _tree(self, client) -> None:
        # (a subflow's own tasks say what it does: the task runs standing for them are left out)
        self.flow_runs, self._subflow_tasks = await flow_run_tree(client, self.flow_run_id)

    async def _task_lines(self, client, final: bool) -> None:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
        from prefect.client.schemas.sorting import TaskRunSort

        runs = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=self.flow_runs)),
            sort=TaskRunSort.EXPECTED_START_TIME_ASC,
        )
        runs = [r for r in runs if r.id not in self._subflow_tasks]
        names = [task_name(r.name) for r in runs]
        now = time.monotonic()
        for name in dict.fromkeys(names):
            group = [r for r, n in zip(runs, names) if n == name]
            if name.endswith(SHARDS):  # a task run once per shard: one count line
                done = sum(1 for r in group if r.state is not None and r.state.is_final())
                # the denominator: the shards the stage planned (its log line), never the task runs made so far
                total = max(self._shard_totals.get(name, 0), len(group))
                was_done, was_total, printed = self._groups.get(name, (0, 0, -1e9))
                changed = (done, total) != (was_done, was_total)
                if changed and (done == total or final or now - printed >= GROUP_EVERY_S):
                    failed = sum(1 for r in group if r.state is not None and r.state.is_failed())
                    tail = f" ({failed} failed)" if failed else ""
                    of = f" of {total}" if name in self._shard_totals else ""
                    self.printer.line(f"{self.stamp()}{name}: {done}{of} completed{tail}")
                    self._groups[name] = (done, total, now)
                continue
            for run in group:
                state = run.state.name if run.state else "Pending"
                if run.state is not None and run.state.is_final():
                    if self._states.get(run.id) != state:
                        took = f" in {run.total_run_time.total_seconds():.0f} s" if run.total_run_time else ""
                        self.printer.line(f"{self.stamp()}{name}: {state}{took}")
                        self._states[run.id] = state
                elif run.state is not None and run.state.is_running() and run.id not in self._announced:
                    started = run.start_time.timestamp() if run.start_time else time.time()
                    if time.time() - started >= ANNOUNCE_AFTER_S or name == "fit":
                        self.printer.line(f"{self.stamp()}{name}: running")
                        self._announced.add(run.id)

    async def _log_lines(self, client) -> None:
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp
        from prefect.client.schemas.sorting import LogSort

        flt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=self.flow_runs))
        if self._logs_after is not None:
            # validated as the constructor would: Prefect's `DateTime` from the datetime
            flt.timestamp = LogFilterTimestamp.model_validate({"after_": self._logs_after - timedelta(seconds=1)})
        offset = 0
        while True:
            logs = await client.read_logs(flt, sort=LogSort.TIMESTAMP_ASC, offset=offset, limit=200)
            for log in logs:
                if log.id in self._seen_logs:
                    continue
                self._seen_logs.add(log.id)
                self._logs_after = max(self._logs_after or log.timestamp, log.timestamp)
                first = redact(" ".join((log.message.strip().splitlines() or [""])[0].split()))
                if log.level >= WARNING and first not in self.warnings:
                    self.warnings.append(first)
                elif log.level != 20:
                    continue
                elif m := SHARD_TOTAL.match(first):
                    self._shard_totals[m.group(1)] = int(m.group(2))
                elif EVAL_LINE.match(first):
                    self._bar(first.split(":")[0], f"{self.stamp()}{first}", key=first)
                elif (log.task_run_id is not None and STAGE_LINE.search(first)) or REUSED_RUN.search(first):
                    # (a finished job is returned by the flow itself, outside any task: its line is said too)
                    self.stage_texts.append(first)
                    self.printer.line(f"{self.stamp()}stage: {first}")
            if len(logs) < 200:
                return
            offset += len(logs)

    def _progress(self, final: bool) -> None:
        from cse.tracking.progress import runs_of_flow_runs, training_progress

        now = time.monotonic()
        if not self._training and (final or now - self._searched_at >= MLFLOW_SEARCH_EVERY_S):
            self._searched_at = now
            self._training = [
                v.run_id for v in runs_of_flow_runs([str(i) for i in self.flow_runs]) if v.kind == "training"
            ]
        for run_id in self._training:
            p = training_progress(run_id)
            if p is not None:
                # (a dev score logged after the loss of its step is a change: the line never shows a stale one)
                self._bar(run_id, progress_bar(p, self.printer.tty), key=(p.step, p.loss, p.dev))


def summary(
    flow_run_ids: list[UUID],
    printer: Printer,
    prefect_url: str | None,
    reused: list[str] | None = None,
    table: bool = True,
    warnings: list[str] | None = None,
) -> list:
    """Print the result of an ended flow run: its Prefect page, then each MLflow run it made that has scores, and each
    finished job it returned as it was (`reused`: their MLflow run ids), with its table (unless `table` is False:
    `cse run --quiet`), id, page and job folder; then the `warnings` the stages logged. Returns the runs shown
    (`cse.tracking.progress.RunView`)."""
    from cse.tracking.progress import runs_by_id, runs_of_flow_runs, summary_lines, summary_runs

    if prefect_url:
        printer.line(f"    Prefect flow run: {prefect_url}")
    made = summary_runs(runs_of_flow_runs([str(i) for i in flow_run_ids]))
    views = made + [v for v in runs_by_id(reused or []) if v.run_id not in {m.run_id for m in made}]
    for view in views:
        if table:
            printer.line("")
        for text in summary_lines(view, table=table):
            printer.line("\n".join("    " + line for line in text.splitlines()))
    if warnings:
        printer.line("    warnings the stages logged (the worker log has them whole):")
        for text in warnings:
            printer.line(f"      {text}")
    return views
