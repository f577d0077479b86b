"""storage/settings.py: the environment read by pydantic-settings, with the defaults and messages of its table."""

from __future__ import annotations

from pathlib import Path

import pytest

from cse.storage.settings import REPO_ROOT, ShardRunnerSettings, get_settings, shard_runner_settings

VARIABLES = (
    "CSE_HOME",
    "CSE_DATA_ROOT",
    "CSE_SHARED_DATA",
    "MLFLOW_TRACKING_URI",
    "CSE_MLFLOW_ARTIFACTS",
    "CSE_MLFLOW_UI_URL",
    "CSE_TASK_RUNNER",
    "CSE_DASK_ADDRESS",
    "CSE_DASK_WORKERS",
    "CSE_DASK_THREADS_PER_WORKER",
)


@pytest.fixture
def env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_defaults_follow_cse_home(env, tmp_path):
    env.setenv("CSE_HOME", str(tmp_path / "home"))
    s = get_settings()
    assert s.home == tmp_path / "home" and s.data_root == tmp_path / "home" / "data"
    assert s.mlflow_tracking_uri == f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"
    assert s.mlflow_artifact_root == tmp_path / "home" / "mlartifacts"
    assert s.shared_data == (REPO_ROOT.parent / "shared" / "data").resolve()
    assert s.mlflow_ui_url == "http://127.0.0.1:5000" and s.shard_runner == ShardRunnerSettings()


def test_every_variable_is_read_and_an_empty_one_counts_as_unset(env, tmp_path):
    env.setenv("CSE_HOME", "")
    assert get_settings().home == (REPO_ROOT / ".cse").resolve()
    env.setenv("CSE_HOME", str(tmp_path))
    env.setenv("CSE_DATA_ROOT", str(tmp_path / "d"))
    env.setenv("CSE_SHARED_DATA", str(tmp_path / "s"))
    env.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    env.setenv("CSE_MLFLOW_ARTIFACTS", str(tmp_path / "a"))
    env.setenv("CSE_TASK_RUNNER", " Dask-Local ")
    env.setenv("CSE_DASK_WORKERS", "2")
    env.setenv("CSE_DASK_THREADS_PER_WORKER", " 4 ")
    s = get_settings()
    assert (s.data_root, s.shared_data, s.mlflow_artifact_root) == (tmp_path / "d", tmp_path / "s", tmp_path / "a")
    assert s.mlflow_tracking_uri == s.mlflow_ui_url == "http://mlflow.example:5000"  # the server's UI
    assert s.shard_runner == ShardRunnerSettings("dask-local", None, 2, 4)
    env.setenv("CSE_MLFLOW_UI_URL", "https://ui.example")
    assert get_settings().mlflow_ui_url == "https://ui.example"


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"CSE_DASK_WORKERS": "0"}, "CSE_DASK_WORKERS must be an integer >= 1, got '0'"),
        ({"CSE_DASK_THREADS_PER_WORKER": "many"}, "CSE_DASK_THREADS_PER_WORKER must be an integer >= 1, got 'many'"),
        ({"CSE_TASK_RUNNER": "ray"}, "CSE_TASK_RUNNER must be one of ['local', 'dask-local', 'dask'], got 'ray'"),
        (
            {"CSE_TASK_RUNNER": "dask"},
            "CSE_TASK_RUNNER=dask needs CSE_DASK_ADDRESS (the scheduler, e.g. tcp://host:8786)",
        ),
        (
            {"CSE_TASK_RUNNER": "local", "CSE_DASK_ADDRESS": "tcp://h:8786"},
            "CSE_DASK_ADDRESS is set but CSE_TASK_RUNNER='local': unset one of them",
        ),
    ],
)
def test_a_wrong_value_is_one_plain_message_naming_the_variable(env, variables, message):
    for name, value in variables.items():
        env.setenv(name, value)
    for read in (shard_runner_settings, get_settings):
        with pytest.raises(ValueError) as e:
            read()
        assert str(e.value) == message  # the variable's own sentence, not pydantic's report around it


def test_an_address_alone_means_the_dask_scheduler(env):
    env.setenv("CSE_DASK_ADDRESS", " tcp://h:8786 ")
    assert shard_runner_settings() == ShardRunnerSettings("dask", "tcp://h:8786")
    assert isinstance(get_settings().home, Path)


def test_outside_a_checkout_the_home_is_the_documented_default_never_the_current_folder(monkeypatch, tmp_path):
    """Issue 44, item 7: without CSE_HOME, code that is not a checkout (an installed package) used `./.cse`, so a
    command run from another folder made a data root there. It is `~/.cse` (`HOME_OUTSIDE_CHECKOUT`)."""
    from cse.storage import settings

    monkeypatch.setattr(settings, "REPO_ROOT", tmp_path / "site-packages")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CSE_HOME")
    assert not settings.in_checkout()
    assert settings.get_settings().home == (tmp_path / "home" / ".cse").resolve()
