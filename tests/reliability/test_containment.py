"""Issue 23 item 1 (path containment) and the `cse dataset` rough edges: every key from a user is one safe name inside
its kind's folder, every folder a command takes has the shape it expects, and a damaged dataset is not "missing"."""

from __future__ import annotations

import json

import pytest

from cse.ops.cli import main as cse
from cse.storage.layout import DataRoot
from cse.storage.paths import PathRefused, check_key, contained
from cse.storage.runs import RunDir
from tests.reliability.conftest import ingest


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("cse: error:")]
    assert len(lines) == 1 and lines[0] == err.strip().splitlines()[-1], err  # one line, the last one
    return lines[0]


def test_a_key_leaving_the_data_root_is_refused_not_read(ingest_config, root, capsys):
    """The campaign's case: a manifest outside the data root was read and reported as an nli dataset."""
    nli = ingest("nli", ingest_config)
    evil = root.root.parent / "evil"  # a folder that looks like a dataset, outside the data root
    evil.mkdir()
    (evil / "manifest.json").write_text((root.dataset_dir("nli", nli.key) / "manifest.json").read_text())
    for flags in ([], ["--hf"]):
        assert cse(["dataset", "nli", "../../../../evil", *flags]) == 2
        line = _one_error_line(capsys)
        assert "'../../../../evil' refused" in line and "nli dataset key" in line
    wiki = ingest("wiki1m", ingest_config)
    assert cse(["dataset", "nli", f"../wiki1m/{wiki.key}"]) == 2  # a wiki1m dataset labelled nli
    assert "refused" in _one_error_line(capsys)
    assert cse(["dataset", "nli", nli.key]) == 0 and f"nli/{nli.key}" in capsys.readouterr().out


@pytest.mark.parametrize("key", ["/etc", "..", "a/../../b", "x.lock", "k.shards", "", " key", "a" * 201, "ok\nno"])
def test_every_unsafe_key_form_is_refused(key):
    """New cases of the class: absolute paths, `..`, the work folders and locks beside datasets, odd characters."""
    with pytest.raises(PathRefused):
        check_key(key)
    with pytest.raises(PathRefused):
        DataRoot("/tmp/nowhere").dataset_dir("tokens", key)


def test_a_flow_parameter_key_is_refused_before_any_path_is_built(root):
    """The corrupt flow's `tokens_key` parameter and a run key reach `storage/` through the same check."""
    from cse.config.stages import CorruptConfig
    from cse.tasks.corrupt import plan_corruption

    with pytest.raises(PathRefused, match="tokens dataset key '../nli/x' refused"):
        plan_corruption("../nli/x", CorruptConfig())
    with pytest.raises(PathRefused, match="run key"):
        RunDir("d2cse", "../../../tmp")
    with pytest.raises(PathRefused, match="outside"):
        contained(root.root, "../x", "folder")


@pytest.mark.parametrize("command", [["card"], ["deliver-metrics"]])
def test_commands_taking_a_job_folder_check_its_shape(command, tmp_path, capsys):
    """`cse card /etc` printed `IndexError: 2`; now it says what it expected (and so for any other folder)."""
    for folder in ("/etc", "/", str(tmp_path)):
        status = cse([*command, folder])
        captured = capsys.readouterr()
        text = captured.err + captured.out
        assert status in (1, 2) and "IndexError" not in text and "Traceback" not in text
        assert "not a training job folder <CSE_HOME>/runs/<method>/<run key>" in text


def test_a_damaged_dataset_is_named_damaged_not_missing(ingest_config, root, capsys):
    nli = ingest("nli", ingest_config)
    (root.dataset_dir("nli", nli.key) / "manifest.json").write_text("{ not json")
    assert cse(["dataset", "nli", nli.key]) == 2
    line = _one_error_line(capsys)
    assert f"dataset nli/{nli.key} is damaged" in line and "manifest.json" in line and "run the stage first" not in line
    assert cse(["dataset", "nli"]) == 2  # the newest of the kind: none intact, one damaged
    assert "is damaged" in _one_error_line(capsys)
    assert cse(["dataset", "nli", "0123abcd"]) == 2 and "no nli dataset '0123abcd'" in _one_error_line(capsys)


def test_one_warning_per_damaged_dataset_per_command(ingest_config, root, caplog, capsys):
    nli = ingest("nli", ingest_config)
    folder = root.dataset_dir("nli", nli.key)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["file_sizes"] = {k: v + 1 for k, v in manifest["file_sizes"].items()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    from cse.storage import integrity

    integrity._WARNED.clear()  # a fresh command
    caplog.clear()
    assert cse(["report"]) == 0
    assert cse(["sql", "select count(*) from manifests"]) == 0
    warned = [r.getMessage() for r in caplog.records if "left out damaged dataset" in r.getMessage()]
    assert len(warned) == 1 and f"nli/{nli.key}" in warned[0]


# ------------------------------------------------------------------ issue 32: links and folders outside $CSE_HOME


def test_a_job_whose_method_folder_links_outside_the_home_is_refused_before_it_starts(job, isolated_home, tmp_path):
    """The campaign's case: `$CSE_HOME/runs/simcse` a link to a folder outside the root. Training wrote there and
    finished; the export task then refused the folder (`is not a training job folder`). Now the link is refused
    before the job's folder is made, naming it and its target."""
    import mlflow

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (isolated_home / "runs").mkdir()
    (isolated_home / "runs" / "simcse").symlink_to(outside)
    with pytest.raises(PathRefused, match=rf"{isolated_home}/runs/simcse is a symbolic link to {outside}: refused"):
        job()
    assert list(outside.iterdir()) == []  # nothing written outside the home
    assert mlflow.search_runs(experiment_names=["simcse"], output_format="list") == []  # no run started


@pytest.mark.parametrize("link", ["runs", "runs/simcse/k1"])
def test_a_link_anywhere_below_the_home_is_refused(link, isolated_home, tmp_path):
    """New cases of the class: `runs` itself, and a job folder, as links."""
    target = tmp_path / "target"
    target.mkdir()
    (isolated_home / link).parent.mkdir(parents=True, exist_ok=True)
    (isolated_home / link).symlink_to(target)
    with pytest.raises(PathRefused, match="is a symbolic link"):
        RunDir("simcse", "k1")
    assert list(target.iterdir()) == []


def _finished_job_outside(tmp_path) -> RunDir:
    job = RunDir("simcse", "k1", home=tmp_path / "other_home")
    (job.export).mkdir()
    (job.export / "modules.json").write_text("[]")
    job.set_result({"run_id": "0" * 32, "run_dir": str(job.path), "steps": 1, "resumed_from": None})
    return job


@pytest.mark.parametrize("command", [["card"], ["deliver-metrics"]])
def test_commands_refuse_a_job_folder_outside_the_home(command, tmp_path, capsys):
    """The campaign's `cse card <folder outside CSE_HOME>` wrote a README there; `deliver-metrics` (a new case) would
    have sent and deleted that folder's spool."""
    job = _finished_job_outside(tmp_path)
    job.metrics_spool.write_text('{"metrics": {"loss": 1.0}, "step": 1, "timestamp": 0}\n')
    status = cse([*command, str(job.path)])
    captured = capsys.readouterr()
    assert status in (1, 2) and "lies outside CSE_HOME=" in captured.err + captured.out
    assert not (job.export / "README.md").exists() and job.metrics_spool.is_file()
