"""`python -m cse.ops.prefect_setup`: the work pools, concurrency limits and automation the services need, created
once and kept as they are afterwards (against the session's Prefect test server)."""

from __future__ import annotations

import uuid

import pytest

from cse.ops import prefect_setup


def test_pools_and_limits_are_created_once_and_kept(prefect_harness, capsys):
    from prefect import get_client

    tag = uuid.uuid4().hex[:8]
    pool, limit = f"setup-{tag}", f"gpu-setup-{tag}"
    argv = ["--pool", pool, "--pool", pool, "--limit", f"{limit}=2"]
    prefect_setup.main(argv)
    assert f"(created: {pool})" in capsys.readouterr().out
    with get_client(sync_client=True) as client:
        assert client.read_work_pool(pool).type == "process"
        assert client.read_global_concurrency_limit_by_name(limit).limit == 2
    # a second run creates nothing, and an existing limit keeps its size
    prefect_setup.main(["--pool", pool, "--limit", f"{limit}=5"])
    assert capsys.readouterr().out.count("(created: none)") == 2
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(limit).limit == 2


@pytest.mark.parametrize("bad", ["gpu", "gpu=0", "gpu=two", "=1", "a b=1"])
def test_a_bad_limit_is_refused_with_its_text(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        prefect_setup.main(["--limit", bad])
    assert exc.value.code == 2
    assert repr(bad) in capsys.readouterr().err
