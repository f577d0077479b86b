"""The step fingerprint (benchmarks/step_fingerprint.py) is deterministic: two runs of one method on this tree write
the same bytes, so a difference between two trees is a change of batches or gradients, not noise."""

from __future__ import annotations

import json

from benchmarks.step_fingerprint import main


def test_two_runs_of_the_fingerprint_are_byte_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("CSE_HOME", str(tmp_path / "home"))  # (restored after the test: main sets it per run)
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    main(["--out", str(first), "--methods", "simcse", "--threads", "1"])
    main(["--out", str(second), "--methods", "simcse", "--threads", "1"])
    assert first.read_bytes() == second.read_bytes()
    found = json.loads(first.read_text())["simcse"]
    assert [row["step"] for row in found["logged"] if "loss" in row] == [1, 2, 3]
    assert len(found["param_abs_sums"]) == 1 and all(float(v) > 0 for v in found["param_abs_sums"][0].values())
