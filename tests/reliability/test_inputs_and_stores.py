"""Issue 23 items 7 and 8: an empty source is refused at ingestion naming the file and the count; out-of-space errors
name the dataset and its folder; a read-only MLflow store says so first."""

from __future__ import annotations

import errno

import pytest

from cse.config.stages import IngestConfig, NliSource, WikiSource
from cse.tasks.ingest import EmptySourceError
from tests.reliability.conftest import ingest
from tests.reliability.test_read_only import in_read_only


@pytest.mark.parametrize(
    "content,dataset",
    [
        (b"", "wiki1m"),  # the campaign's 0-line Wiki1M
        (b"\n\n   \n\n", "wiki1m"),  # new case: only blank lines
        (b"sent0,sent1,hard_neg\n", "nli"),  # new case: an NLI file with its header only
    ],
)
def test_a_source_without_usable_rows_is_refused_at_ingestion(content, dataset, tmp_path, root):
    src = tmp_path / f"empty-{dataset}.txt"
    src.write_bytes(content)
    config = IngestConfig(wiki=WikiSource(path=str(src)), nli=NliSource(path=str(src)))
    with pytest.raises(EmptySourceError, match=rf"{src}: 0 usable rows \(\d+ rows read"):
        ingest(dataset, config)
    assert root.list(dataset) == []  # nothing published


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_out_of_space_names_the_dataset_and_its_folder(code, ingest_config, root, monkeypatch):
    import cse.storage.datasets

    def full(*a, **k):
        raise OSError(code, "No space left on device")

    monkeypatch.setattr(cse.storage.datasets, "write_parquet", full)
    with pytest.raises(
        OSError, match=rf"while building dataset nli/\w+ in {root.kind_dir('nli')}.*nothing was published"
    ) as e:
        ingest("nli", ingest_config)
    assert e.value.errno == code and root.list("nli") == []


def test_a_read_only_mlflow_store_says_so_first(isolated_home, monkeypatch):
    from cse.tracking.store import configure_mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{isolated_home / 'mlflow.db'}")
    configure_mlflow()  # the store exists (migrated); then the home becomes read-only

    def start_a_stage():
        from cse.tracking.stage_runs import stage_run
        from cse.tracking.store import TrackingStoreReadOnly

        try:
            with stage_run("data", "read-only-store"):
                pass
        except TrackingStoreReadOnly as e:
            return str(e).splitlines()[0]
        return "no error"

    first_line = in_read_only(isolated_home, start_a_stage)
    assert first_line.startswith(f"the MLflow store sqlite:///{isolated_home / 'mlflow.db'} is read-only"), first_line
