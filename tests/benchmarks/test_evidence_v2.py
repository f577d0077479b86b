"""benchmarks/evidence_v2.py's bookkeeping (no training): the swap task, the knob the power checks choose, pairing by
seed, parts and merging beside protocol 1, and the fixed protocol."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import evidence as ev
from benchmarks import evidence_v2 as v2
from cse.storage.training_data import TokenRows

FIRST, SECOND = list(v2.ARMS)  # the two methods of protocol 2, in their evidence order


def _rows(lengths: list[int]) -> TokenRows:
    seqs = [np.arange(100 * i, 100 * i + n, dtype=np.int64) for i, n in enumerate(lengths)]
    return TokenRows(ids=np.arange(len(seqs)), seqs={"text": seqs})


def test_the_swap_task_swaps_within_split_and_length_and_labels_the_differences():
    rows = _rows([5, 5, 5, 5, 7, 5, 5, 5])  # the first 5 train, the last 3 are held out
    swap = v2.swap_corruption(rows, 5, probability=0.5, variants=2, seed=0)
    assert swap.variants == 2
    swapped = 0
    for v in range(2):
        for i, (cor, lab) in enumerate(zip(swap.corrupted[("text", v)], swap.labels[("text", v)])):
            original = rows.seqs["text"][i]
            assert len(cor) == len(original) and np.array_equal(lab, (cor != original).astype(np.int64))
            source = int(cor[0]) // 100  # the row it came from
            assert (source < 5) == (i < 5)  # never across the train / held-out split
            swapped += source != i
        assert np.array_equal(swap.corrupted[("text", v)][4], rows.seqs["text"][4])  # no partner of length 7
    assert 0 < swapped < 14


def _power(method, value, gap):
    return {"kind": "power", "method": method, "arm": "method", "knob_value": value, "passes": gap >= 0.05}


def test_the_knob_is_the_first_listed_rate_that_passes_else_the_last_without_power():
    _, rates = v2.KNOBS[FIRST]
    assert v2.chosen_knob([], FIRST) is None
    assert v2.chosen_knob([_power(FIRST, rates[0], 0.01)], FIRST) is None  # the next check is still to run
    assert v2.chosen_knob([_power(FIRST, rates[0], 0.01), _power(FIRST, rates[1], 0.2)], FIRST) == (rates[1], True)
    assert v2.chosen_knob([_power(FIRST, r, 0.0) for r in rates], FIRST) == (rates[-1], False)
    assert v2.chosen_knob([_power(FIRST, rates[0], 0.3)], FIRST) == (rates[0], True)


def _sts(method, arm, seed, final, mechanism=None, device=None, steps=1000):
    rec = {
        "kind": "sts",
        "method": method,
        "arm": arm,
        "seed": seed,
        "steps": steps,
        "start": 80.0,
        "final": final,
        "delta": round(final - 80.0, 2),
        "seconds": {"train_and_eval": 100.0},
    }
    if mechanism is not None:
        rec["mechanism"] = dict(zip(("true_h", "rolled_h", "no_h", "gap", "constant_guess"), mechanism))
    if device is not None:
        rec["device"] = device
    return rec


def test_summary_and_rows_pair_by_seed_and_label_protocol_2():
    rates = v2.KNOBS[FIRST][1]
    records = [
        _power(FIRST, rates[0], 0.0) | {"probe": dict.fromkeys(("true_h", "rolled_h", "no_h", "constant_guess"), 0.5)},
        _power(FIRST, rates[1], 0.2) | {"probe": dict.fromkeys(("true_h", "rolled_h", "no_h", "constant_guess"), 0.5)},
        _sts(FIRST, "method", 0, 82.0, (0.3, 0.4, 0.5, 0.1, 0.6)),
        _sts(FIRST, "lambda0", 0, 81.0),
    ]
    for r in records[:2]:
        r["probe"]["gap"] = 0.0 if r["knob_value"] == rates[0] else 0.2
        r |= {"label": "m", "knob": v2.KNOBS[FIRST][0]}
    report = {"protocol": v2.protocol_hash(), "records": records}
    report["summary"] = v2.summary(report)
    s = report["summary"][FIRST]
    assert s["knob"] == {"name": v2.KNOBS[FIRST][0], "value": rates[1], "passed": True}
    assert s["method_minus_control"]["lambda0"]["mean"] == pytest.approx(1.0)
    assert s["arms"]["method"]["mechanism"]["gap"]["mean"] == pytest.approx(0.1)
    assert "mechanism" not in s["arms"]["lambda0"]
    rows = v2.readme_rows(report)
    assert len(rows) == sum(len(a) - 1 for a in v2.ARMS.values())
    assert rows[0].startswith("| 2 | ") and rows[0].endswith("| 1 / 1 | +2.00 | +1.00 | +1.00 (better in 1/1) |")
    assert "partial: " in v2.status_line(report)
    md = v2.markdown(report)
    assert "| no |" in md and "| yes |" in md  # the power column of both checks


def test_merge_keeps_protocol_1_and_refuses_parts_of_another_protocol(tmp_path):
    out = tmp_path / "evidence.json"
    v1 = {"protocol": ev.protocol_hash(), "cells": [], "missing": [], "summary": {}}
    out.write_text(json.dumps(v1))
    home = tmp_path / "home"
    v2.parts(home).write("a", {"protocol": v2.protocol_hash(), "records": [_sts(FIRST, "lambda0", 0, 81.0)]})
    v2.merge(home, out, "merge", None, None)
    full = json.loads(out.read_text())
    assert full["protocol"] == ev.protocol_hash() and full["cells"] == []  # protocol 1 as it was
    assert full["protocol_v2"]["protocol"] == v2.protocol_hash() and len(full["protocol_v2"]["records"]) == 1
    assert (tmp_path / "evidence_v2.md").is_file()
    table = v2.readme_table(full)
    assert table.splitlines()[1].startswith("Protocol 2 (1,000 steps): 0 power checks; 1 of its 12 STS runs measured")
    v2.parts(home).write("b", {"protocol": "0" * 16, "records": []})
    with pytest.raises(SystemExit, match="protocol"):
        v2.merge(home, out, "merge", None, None)


def test_gpu_runs_are_a_set_of_their_own_never_paired_with_cpu_runs(tmp_path):
    gpu = "cuda: NVIDIA H100 80GB HBM3"
    records = [
        _sts(FIRST, "method", 0, 82.0),  # CPU: method only
        _sts(FIRST, "method", 0, 84.0, device=gpu),
        _sts(FIRST, "lambda0", 0, 83.0, device=gpu),
    ]
    assert len({v2.record_id(r) for r in records}) == 3  # the same run on two devices: two records
    home = tmp_path / "home"
    v2.parts(home).write("cpu", {"protocol": v2.protocol_hash(), "records": records[:1]})
    v2.parts(home).write("gpu", {"protocol": v2.protocol_hash(), "records": records[1:]})
    out = tmp_path / "evidence.json"
    v2.merge(home, out, "merge", None, None)
    report = json.loads(out.read_text())["protocol_v2"]
    assert report["summary"][FIRST]["method_minus_control"] == {}  # no CPU control: nothing paired across devices
    assert report["summary_gpu"][FIRST]["method_minus_control"]["lambda0"]["mean"] == pytest.approx(1.0)
    assert report["complete"] == {"cpu": False, "gpu": False}
    status = v2.status_line(report)
    assert "1 of its 12 STS runs measured on the CPU" in status and "2 of its 12 STS runs measured on one GPU" in status
    md = (tmp_path / "evidence_v2.md").read_text()
    assert "The same STS runs on one GPU (NVIDIA H100 80GB HBM3)" in md
    rows = v2.readme_rows(report)
    assert [r.split(" | ")[0] for r in rows] == ["| 2"] * 2 + ["| 2, GPU"] * 2
    assert rows[2].endswith("| 1 / 1 | +4.00 | +3.00 | +1.00 (better in 1/1) |")


def test_merge_refuses_a_run_shorter_than_the_protocol(tmp_path):
    """A rehearsal (benchmarks/evidence_device.py --steps) never reaches the report."""
    home = tmp_path / "home"
    v2.parts(home).write("r", {"protocol": v2.protocol_hash(), "records": [_sts(FIRST, "method", 0, 81.0, steps=4)]})
    with pytest.raises(SystemExit, match="shorter than the protocol"):
        v2.merge(home, tmp_path / "evidence.json", "merge", None, None)


def test_protocol_2_is_the_one_its_records_were_run_under():
    """The protocol was committed before its runs: its hash must not move (protocol 1's neither)."""
    assert ev.protocol_hash() == "0713ae7325e122a8"
    assert v2.protocol_hash() == "162efe38b9ce82b0"
    assert [a.name for arms in v2.ARMS.values() for a in arms] == ["method", "lambda0"] * 2
    assert {m: k[1][0] for m, k in v2.KNOBS.items()} == {FIRST: None, SECOND: None}  # the job's own rate first
