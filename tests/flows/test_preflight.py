"""Acceptance (issue 24): `train-d2cse/default` on this machine fails within 60 s, before any stage, with one reason
naming `bert-base-uncased` and the fix; the Wiki1M sample warning is in the flow run's log (the Prefect UI)."""

from __future__ import annotations

import asyncio
import time


def test_default_preset_fails_in_seconds_naming_the_backbone_and_the_fix(
    prefect_harness, shared_data, isolated_home, tmp_path, monkeypatch
):
    from huggingface_hub import constants
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    from cse.flows.train import train_d2cse
    from cse.ops.deployments import failures_of

    # the worker's environment (scripts/env.sh): sources from the local mirror; HF_HUB_OFFLINE as the CI sets it or
    # not (the hub does not answer here either way); an empty HF cache, so no model downloaded elsewhere counts
    monkeypatch.setenv("CSE_SOURCE_MIRROR", str(shared_data))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    t0 = time.monotonic()
    state = train_d2cse(preset="default", return_state=True)
    elapsed = time.monotonic() - t0
    assert state.is_failed()
    assert elapsed < 60, f"the preflight failure took {elapsed:.1f} s"

    async def reasons():
        async with get_client() as client:
            return await failures_of(client, state.state_details.flow_run_id)

    (failure,) = asyncio.run(reasons())  # what `cse run` prints: one reason, from the flow's own code
    assert failure.task is None
    assert failure.reason.startswith(
        "PreflightError: preflight: train-d2cse (preset default) cannot run on this machine, nothing was started; "
        "2 things missing: 1. backbone and tokenizer 'bert-base-uncased': not in the local Hugging Face cache"
    )
    assert """-p 'overrides={"backbone": "packaged:minilm"}'""" in failure.reason
    assert "the deployment train-d2cse/smoke" in failure.reason
    assert "2. corruption generator 'distilbert-base-uncased'" in failure.reason
    assert not (isolated_home / "data" / "datasets").exists()  # nothing ingested, tokenised or corrupted

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        )
    warnings = [lg.message for lg in logs if lg.message.startswith("preflight: Wiki1M is a sample")]
    assert len(warnings) == 1 and "holds 11,913 lines, not the full 1,000,000" in warnings[0]
