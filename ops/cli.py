"""`cse` command line: look at what the pipeline produced, run its deployments, publish its models.

`cse COMMAND -h` says what a command does. Errors print one line (`cse: error: ...`) and exit with status 2;
`cse --debug ...` shows the traceback. Every line printed about a value passes two rules: credentials masked
(`cse.storage.secrets.redact`), the values echoed cut and escaped (`cse.config.limits.one_line`: what was given on the
command line, a path, SQL quoted back).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Literal

import duckdb
import pandas as pd
import typer

from cse.config.limits import one_line
from cse.config.methods import DEFAULT_METHOD
from cse.storage.catalog import damaged, query, refresh_catalog
from cse.storage.layout import KINDS, DataRoot
from cse.storage.secrets import install_log_redaction, redact
from cse.storage.settings import get_settings, in_checkout

# The deployment that makes each kind of dataset (named when there is none yet)
PRODUCED_BY = {
    "wiki1m": ("ingest/default", ""),
    "nli": ("ingest/default", ""),
    "sts": ("ingest/default", ""),
    "transfer": ('ingest/default -p \'config={"datasets": ["transfer"]}\'', ""),
    "tokens": ("tokenize/default", " (corrupt/smoke tokenises too)"),
    "corruption": ("corrupt/smoke", " (or corrupt/default, or any D2CSE/DiffCSE training deployment)"),
    "evaluations": ("evaluate/default", " (every training job evaluates too)"),
    "comparisons": ("compare/default", f", after a training run (e.g. train-{DEFAULT_METHOD}/smoke)"),
    "generator": ("fit-generator/default", ""),
}

# The commands: each `@app.command()` below, its docstring its help; `main` runs them (errors as one line)
app = typer.Typer(
    add_completion=False, help=__doc__, rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]}
)


@app.callback()
def _options(debug: Annotated[bool, typer.Option("--debug", help="show the traceback of an error")] = False) -> None:
    """`--debug`, declared for the help: `main` takes it out of the command line wherever it is."""


def _nonblank(_ctx, param, text: str) -> str:
    """The value of `param` when it holds more than whitespace (`""` is not "the current folder")."""
    if not text.strip():
        raise typer.BadParameter(f"the {param.metavar} is empty")
    return text


def _arg(metavar: str, help: str | None = None, nonblank: bool = True):
    """A positional argument, refused when empty (`nonblank`)."""
    return typer.Argument(metavar=metavar, callback=_nonblank if nonblank else None, help=help)


def _flag(name: str, help: str):
    """An option without a value (`--quiet`, never `--no-quiet`)."""
    return typer.Option(name, help=help)


def _seconds(text: str) -> float:
    """A number of seconds > 0 (`cse run --timeout`)."""
    try:
        value = float(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise typer.BadParameter(f"{text!r}: the timeout must be a finite number of seconds > 0")
    return value


def _data_root() -> DataRoot:
    """The data root of the settings; outside a checkout with neither CSE_HOME nor CSE_DATA_ROOT set, which one (the
    default `~/.cse/data`) is said on stderr first."""
    settings = get_settings()
    if not in_checkout() and not os.environ.get("CSE_HOME", "").strip() and not os.environ.get("CSE_DATA_ROOT", ""):
        print(
            f"cse: data root {settings.data_root} (CSE_HOME is unset outside a checkout: the default ~/.cse; set "
            "CSE_HOME to use another)",
            file=sys.stderr,
        )
    return DataRoot(settings.data_root)


def _print(df: pd.DataFrame, decimals: dict[str, int] | None = None) -> None:
    """Print `df` without its index; the float columns of `decimals` with that many decimals; a missing value is `-`
    (never `NaN` or `None`)."""
    df = df.copy()
    for col, n in (decimals or {}).items():
        if col in df.columns:
            df[col] = [f"{v:.{n}f}" if v is not None and not pd.isna(v) else None for v in df[col]]
    df = df.astype(object).where(df.notna(), "-")
    with pd.option_context("display.max_columns", 30, "display.width", 200, "display.max_colwidth", 60):
        print(df.to_string(index=False) if len(df) else "(no rows)")


def _views(root: DataRoot) -> list[str]:
    """The catalog's views and tables, by name."""
    return query(root, "SELECT table_name FROM information_schema.tables ORDER BY 1").table_name.tolist()


@app.command()
def report() -> int:
    """Datasets and evaluations in the data root. With the damaged datasets and the corruption statistics."""
    refresh_catalog(root := _data_root())
    print(f"Data root: {root.root}\n\nDatasets:")
    _print(
        query(
            root,
            "SELECT kind, dataset_key, rows, created[:19] AS created, "
            "json_extract_string(source, '$.file') AS source FROM manifests ORDER BY created",
        )
    )
    if bad := damaged(root):
        print(
            "\nDamaged datasets (left out of the views; `cse verify` checks everything, the next stage run rebuilds them):"
        )
        for p in bad:
            print(f"  {p}")
    if root.list("corruption"):
        print("\nCorruption statistics:")
        _print(query(root, "SELECT * FROM corruption_stats"), {"masked_ratio": 4, "replaced_ratio": 4})
    if root.list("evaluations"):
        print(
            "\nSTS test evaluations (Spearman x100; STS12-16 'all', STS-B/SICK-R test), newest last; a training run's "
            "label says what differs from its preset, `before` is its backbone's Avg. before training (the row "
            "`backbone ...`):"
        )
        scores = ("sts12", "sts13", "sts14", "sts15", "sts16", "sts-b", "sick-r", "avg", "before", "r1")
        columns = set(query(root, "SELECT * FROM evaluations_all LIMIT 0").columns)
        before = (  # (data roots written before the column existed have none)
            ("b.sts_avg", "LEFT JOIN evaluations_all b ON b.evaluation_id = e.backbone_evaluation")
            if "backbone_evaluation" in columns
            else ("NULL", "")
        )
        _print(
            query(
                root,
                "SELECT e.created[:19] AS created, e.label, e.sts12, e.sts13, e.sts14, e.sts15, e.sts16, "
                'e.stsb AS "sts-b", e.sickr AS "sick-r", e.sts_avg AS avg, '
                f"{before[0]} AS before, e.retrieval_r1 AS r1, e.alignment AS align, e.uniformity AS uniform "
                f"FROM evaluations_all e {before[1]} WHERE e.mode = 'test' ORDER BY e.created",
            ),
            {**dict.fromkeys(scores, 2), "align": 4, "uniform": 4},
        )
    return 0


@app.command()
def deployments() -> int:
    """The deployments on the Prefect server. Each as FLOW/DEPLOYMENT (what `cse run` takes), with what it does."""
    import asyncio

    from cse.ops.deployments import list_deployments

    rows = asyncio.run(list_deployments())
    width = max((len(name) for name, _ in rows), default=0)
    for name, what in rows:
        print(f"{name:<{width}}  {what}".rstrip())
    if not rows:
        print("(no deployments: `make main` or `bash scripts/services.sh up` registers them)")
    return 0


@app.command("prefect-yaml")
def prefect_yaml(
    check: Annotated[
        bool, typer.Option("--check", help="only say whether the file is what the registry generates")
    ] = False,
) -> int:
    """Generate prefect.yaml's training deployments from the method registry.

    One deployment per preset of every method (config/presets.py, its descriptions in PRESET_DESCRIPTIONS), written
    between the file's training comment and its experiments' comment; the rest of the file is kept as written. With
    --check nothing is written and the exit status is 1 when the file differs.
    """
    from cse.ops.deployments import write_prefect_yaml
    from cse.storage.settings import REPO_ROOT

    path = REPO_ROOT / "prefect.yaml"
    same = write_prefect_yaml(path, check=check)
    if same:
        print(f"{path}: the training deployments are the registry's")
    else:
        print(f"{path}: {'differs from' if check else 'rewritten from'} the registry's training deployments")
    return 1 if check and not same else 0


@app.command("deliver-metrics")
def deliver_metrics(
    run_dirs: Annotated[list[str], _arg("RUN_DIR", "job folder ($CSE_HOME/runs/<method>/<key>)", nonblank=False)],
) -> int:
    """Deliver metrics spooled while MLflow was unreachable.

    What each job spooled goes to its MLflow run; exit status 1 when a job's metrics could not be delivered.
    """
    from cse.storage.runs import RunDir
    from cse.tracking.spool import SpoolNotDelivered, deliver_spool

    status = 0
    for path in run_dirs:
        try:
            n = deliver_spool(RunDir.at(path, home=get_settings().home))
        except (SpoolNotDelivered, FileNotFoundError, ValueError) as e:
            _say(f"{path}: not delivered: {e}", [path], err=True)
            status = 1
        else:
            _say(f"{path}: delivered {n} metric values" if n else f"{path}: nothing to deliver", [path])
    return status


# A command waits on an unreachable tracking server this long at most, unless these are set (MLflow's defaults, 7
# retries with backoff and a 120 s timeout, kept `cse card` silent for 4.5 minutes before its error).
INTERACTIVE_MLFLOW = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


@contextmanager
def interactive_mlflow():
    """MLflow's HTTP retries bounded for a command someone waits on (`INTERACTIVE_MLFLOW`, where not set), restored
    afterwards."""
    added = {k: v for k, v in INTERACTIVE_MLFLOW.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@app.command()
def card(
    run_dir: Annotated[str, _arg("RUN_DIR", "job folder ($CSE_HOME/runs/<method>/<key>)")],
    adapter: Annotated[
        str | None,
        typer.Option(metavar="DIR", help="the job's PEFT adapter folder: listed in the card, and given the card too"),
    ] = None,
) -> int:
    """(Re)write the model card of a finished job's export.

    The card (README.md) comes from the job's recorded result, its MLflow run (config, hashes, commit, registered
    version) and its checkpoint. One card, rendered once, is written into the export and into the PEFT adapter folder
    (--adapter, default the job's own `peft-adapter/` when it has one), so that `cse push` takes either.
    """
    from cse.storage.runs import RunDir
    from cse.tracking.model_card import AdapterInfo, card_facts_of_job, write_model_cards

    job = RunDir.at(run_dir, home=get_settings().home)  # never a folder outside $CSE_HOME: the card is written there
    if not (job.export / "modules.json").is_file():
        raise FileNotFoundError(
            f"{job.export} holds no sentence-transformers export (modules.json): has the job finished?"
        )
    if adapter is None and (job.peft_adapter / "adapter_config.json").is_file():
        adapter = str(job.peft_adapter)
    with interactive_mlflow():
        facts = card_facts_of_job(job, adapter=AdapterInfo.from_folder(adapter) if adapter else None)
    for path in write_model_cards(facts, job.export, *([adapter] if adapter else [])):
        print(f"wrote {path}")
    return 0


@app.command()
def push(
    export_dir: Annotated[str, _arg("EXPORT_DIR", "a sentence-transformers export or a PEFT adapter folder")],
    repo_id: Annotated[str, _arg("REPO_ID", "hub model repository (owner/name), created when missing")],
    private: Annotated[bool, _flag("--private", "create the repository private")] = False,
    revision: Annotated[
        str | None, typer.Option(metavar="BRANCH", help="branch to commit to (created when missing; default: main)")
    ] = None,
    token_env: Annotated[
        str | None,
        typer.Option(
            metavar="VAR",
            help="environment variable holding the hub token (default: HF_TOKEN when set, else the hub's stored login)",
        ),
    ] = None,
) -> int:
    """Upload an export folder to the Hugging Face hub. With its model card; prints the URL."""
    from cse.ops.publish import push_export

    result = push_export(export_dir, repo_id, private=private, revision=revision, token_env=token_env)
    _say(
        f"pushed {export_dir} to {result.url}" + (f" (commit {result.commit_url})" if result.commit_url else ""),
        [export_dir],
    )
    return 0


# `cse dataset`'s KIND: storage.layout's KINDS as a type (tests/ops/test_cli_fixes.py checks that they match)
DatasetKind = Literal[
    "wiki1m", "nli", "sts", "transfer", "tokens", "corruption", "evaluations", "comparisons", "generator"
]


@app.command()
def dataset(
    kind: Annotated[DatasetKind, _arg("KIND", nonblank=False)],
    key: Annotated[str | None, _arg("KEY", "dataset key (default: the newest dataset of KIND)", nonblank=False)] = None,
    hf: Annotated[bool, _flag("--hf", "print a Python line opening it as a memory-mapped HF Dataset")] = False,
) -> int:
    """Where a dataset is and what it holds.

    KEY: the newest of KIND when left out. --hf prints one line of Python that opens it as a Hugging Face `Dataset`,
    memory-mapped (its Arrow copy is built first when the dataset predates it).
    """
    from cse.storage.hf import ensure_arrow_copy, find_dataset

    root = _data_root()
    if key is None and not root.list(kind) and not root.dataset_dirs(kind):
        deployment, note = PRODUCED_BY[kind]
        raise FileNotFoundError(
            f"no {kind} dataset under {root.root} yet: run the deployment that makes it, `cse run {deployment}`{note}"
        )
    if hf:
        print(ensure_arrow_copy(root, kind, key).snippet())
        return 0
    ds = find_dataset(root, kind, key)
    m = ds.manifest
    print(
        f"{kind}/{ds.key}: {m.rows:,d} rows, content hash {m.content_hash}, written {m.created[:19]}\n"
        f"folder:  {ds.folder}\nparts:   {', '.join(m.files)}\n"
        f"arrow:   {', '.join(m.arrow.files) if m.arrow else '(not built yet: --hf builds it)'}\n"
        f"schema:  {', '.join(f'{f.name}: {f.type}' for f in ds.arrow_schema())}"
    )
    return 0


@app.command()
def verify(
    quick: Annotated[bool, _flag("--quick", "sizes and row counts only (no content hashes)")] = False,
    move: Annotated[bool, _flag("--quarantine", "move damaged datasets to the quarantine now")] = False,
) -> int:
    """Check every dataset of the data root; exit 1 on damage.

    Sizes, row counts and content hashes (--quick: no hashes). Prints what is damaged (kind, key, file, what).
    Damaged datasets are marked (`damaged.json`: the next stage run that needs one quarantines and rebuilds it) or,
    with --quarantine, moved to the quarantine now.

    Only the repairs write, and each says so: marking, moving, clearing the mark of a dataset a full check finds intact
    again. Nothing else is written, so a read-only data root is checked all the same (a repair it cannot make is said,
    not an error).
    """
    root, full = _data_root(), not quick
    checked, bad = 0, 0
    not_written: list[str] = []
    for kind in KINDS:
        for folder in root.dataset_dirs(kind):
            checked += 1
            if _verify_dataset(root, folder, kind, full, move, not_written):
                bad += 1
    stale = [p for kind in KINDS if root.kind_dir(kind).is_dir() for p in root.kind_dir(kind).rglob(".tmp-*")]
    what = "sizes, row counts and content hashes" if full else "sizes and row counts"
    marked = (
        "; marked: the next stage run that needs one quarantines and rebuilds it (or run `cse verify --quarantine`)"
    )
    summary = f"{bad} damaged{'' if move else marked}" if bad else "all intact"
    print(f"{checked} datasets checked ({what}) under {root.root}: {summary}")
    if not_written:
        print(f"repairs not written (is the data root read-only?): {'; '.join(not_written)}")
    if stale:
        print(
            f"{len(stale)} leftover temporaries of interrupted builds (removed by the next run of their stage): "
            + ", ".join(str(p) for p in stale[:5])
            + (" ..." if len(stale) > 5 else "")
        )
    if bad and not not_written:
        refresh_catalog(root)
    return 1 if bad else 0


def _verify_dataset(root: DataRoot, folder: Path, kind: str, full: bool, move: bool, not_written: list[str]) -> bool:
    """`cse verify` on one dataset: print its damage and mark or move it, or clear the mark of one found intact again.

    Args:
        root: the data root.
        folder: the dataset's folder.
        kind: its kind.
        full: check content hashes too.
        move: move a damaged dataset to the quarantine instead of marking it.
        not_written: told each repair the data root refused.

    Returns:
        Whether the dataset is damaged.
    """
    from cse.storage.integrity import DAMAGED_MARKER, check_dataset, mark_damaged, quarantine

    # a full check finds everything again: an earlier mark is left out, and replaced by this check's result
    problems = check_dataset(folder, kind, folder.name, full=full, marker=not full)
    if not problems:
        if full and (folder / DAMAGED_MARKER).is_file():
            try:
                (folder / DAMAGED_MARKER).unlink()
                print(f"intact again {kind}/{folder.name}: removed its damage mark {folder / DAMAGED_MARKER}")
            except OSError as e:
                not_written.append(f"{folder / DAMAGED_MARKER} not removed ({e.strerror or e})")
        return False
    for pr in problems:
        print(f"DAMAGED {pr}")
    try:
        if move:
            q = quarantine(root.root, folder, kind, folder.name, problems)
            print(f"        moved to {q.moved_to if q else '(already gone)'}")
        else:
            mark_damaged(folder, problems)
    except OSError as e:
        not_written.append(f"{kind}/{folder.name} not {'moved' if move else 'marked'} ({e.strerror or e})")
    return True


class SqlError(Exception):
    """A mistake in the SQL given to `cse sql` (syntax, an unknown view or column, a type): not a damaged file."""


def _read_failure(e: BaseException) -> bool:
    """Whether a DuckDB error is a dataset file that could not be read (damaged, truncated, gone), not a mistake in
    the SQL: only then does `cse` suggest `cse verify`."""
    if isinstance(e, (duckdb.ParserException, duckdb.BinderException, duckdb.CatalogException)):
        return False
    # DuckDB raises its bare `Error` for undecodable Parquet pages, and names the file for a missing footer
    return isinstance(e, duckdb.IOException) or type(e) is duckdb.Error or "parquet" in str(e).lower()


def _clean(text: str, given: list[str]) -> str:
    """`text` as `cse` prints it: credentials masked, the values `given` cut and escaped, one line (`one_line`)."""
    return one_line(redact(text), echoed=given)


def _say(line: str, given: list[str], err: bool = False) -> None:
    """Print one line about the values `given` (on stdout, or stderr with `err`), through `_clean`."""
    print(_clean(line, given), file=sys.stderr if err else sys.stdout)


def _one_line(e: BaseException, given: list[str]) -> str:
    """An exception as one line: its type and message, through `_clean`."""
    return _clean(f"{type(e).__name__}: {str(e).strip() or type(e).__name__}", given)


@app.command(context_settings={"ignore_unknown_options": True})  # (SQL may begin with a `--` comment)
def sql(sql: Annotated[str, _arg("SQL")]) -> int:
    """Any SQL over the DuckDB catalog (`cse sql "SELECT ..."`)."""
    refresh_catalog(root := _data_root())
    try:
        df = query(root, sql)
    except duckdb.CatalogException as e:  # a view missing because its datasets are damaged: say which
        if bad := damaged(root):
            raise RuntimeError(
                f"{' '.join(str(e).split())}; damaged datasets left out of the catalog: " + "; ".join(map(str, bad))
            ) from e
        first = str(e).split("\nLINE ")[0]
        raise SqlError(f"{first} (views: {', '.join(_views(root)) or 'none yet: run a stage first'})") from e
    except duckdb.Error as e:
        if _read_failure(e):
            raise
        raise SqlError(str(e)) from e
    _print(df)
    return 0


@app.command()
def run(
    deployment: Annotated[
        str, _arg("DEPLOYMENT", f"FLOW/DEPLOYMENT, e.g. train-{DEFAULT_METHOD}/smoke", nonblank=False)
    ],
    param: Annotated[
        list[str] | None,
        typer.Option(
            "-p",
            "--param",
            metavar="KEY=VALUE",
            help="a flow parameter (VALUE is JSON when it parses as JSON, else a string); repeatable",
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(metavar="S", parser=_seconds, help="stop waiting after S (> 0) seconds (the run goes on)"),
    ] = None,
    quiet: Annotated[
        bool,
        _flag("--quiet", "no progress or tables: the changes of state, then the stage lines and each MLflow run id"),
    ] = False,
    as_json: Annotated[
        bool, _flag("--json", "the lines on stderr, then one JSON object on stdout: flow run, state, MLflow runs")
    ] = False,
) -> int:
    """Run a deployment, follow it, say why it failed.

    Through the worker; `-p 'config={"mask_ratio": 0.15}'`: JSON values. Prints a line per stage, each stage's cache
    hit or write, the evaluations' and the training steps' progress (loss, last dev score, ETA), then the STS table
    beside the backbone before training and the paper's row, the MLflow run id, the job folder, the Prefect and
    MLflow pages and the warnings the stages logged (a rerun that reuses a finished job prints its result the same);
    on failure the failing task's reason, exit 1. --quiet: the changes of state and, at the end, the stage lines and
    each MLflow run's id, page and job folder. --json: for scripts, one JSON object on stdout.

    Ctrl-C stops following, not the run: `cse run` says so (its id, page, how to cancel it) and offers to cancel it
    (a prompt on a terminal, else a second Ctrl-C within 10 s); exit 130.
    """
    from cse.ops.deployments import run_deployment_cli

    return run_deployment_cli(deployment, param or [], timeout_s=timeout, quiet=quiet, as_json=as_json)


@app.command()
def cancel(run: Annotated[str, _arg("RUN", "the flow run's id or name, as `cse run` printed it")]) -> int:
    """Cancel a flow run that `cse run` started.

    A run not yet started is cancelled at once; a running one is stopped by its worker (its job's MLflow run ends
    KILLED; rerunning the deployment resumes it). Waits up to 30 s for it to end; exit 1 when it is still cancelling.
    """
    from cse.ops.deployments import cancel_cli

    return cancel_cli(run, lambda line: _say(line, [run]))


def main(argv: list[str] | None = None) -> int:
    """The `cse` command line: run a command, printing an error as one line (`--debug` shows the traceback).

    Args:
        argv: the command-line arguments; `None` reads `sys.argv`.

    Returns:
        The exit status.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    install_log_redaction()  # no credential in clear in any warning a command logs
    debug = "--debug" in argv
    try:
        command = typer.main.get_command(app)
        return command.main([a for a in argv if a != "--debug"], prog_name="cse", standalone_mode=False) or 0
    except Exception as e:  # one clear line instead of a traceback (--debug shows it)
        if debug:
            raise
        if isinstance(e, typer.TyperException):  # a usage error: it names the option or argument, then the usage
            ctx = getattr(e, "ctx", None)  # (a click UsageError has one, typer's other exceptions none)
            usage = f" ({' '.join(ctx.get_usage().split())})" if ctx is not None else ""
            message = e.format_message().replace("Value error, ", "")  # (how typer's pydantic words a ValueError)
            print(f"cse: error: {_clean(message, argv)}{usage}", file=sys.stderr)
            return 2
        if isinstance(e, SqlError):
            text = str(e).split("\nLINE ")[0]  # (DuckDB's caret drawing does not survive one line)
            print(f"cse: error: SQL error: {_clean(text, argv)}", file=sys.stderr)
            return 2
        if isinstance(e, duckdb.Error):
            read_failure = _read_failure(e)
        else:
            read_failure = type(e).__module__.startswith("pyarrow") or "parquet" in str(e).lower()
        hint = " (a damaged dataset file? `cse verify` checks the data root)" if read_failure else ""
        print(f"cse: error: {_one_line(e, argv)}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
