"""benchmarks/evidence_v3.py: protocol 3's pinned hash, its rate rule, gate, power and trend, and its CPU rehearsal
(every stage in 2 steps on the tiny BERT from a hand-made export; merge refuses the rehearsal's records)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import evidence_device as ed
from benchmarks import evidence_v2 as v2
from benchmarks import evidence_v3 as v3
from benchmarks.gpu_check import synthetic_rows
from cse.config.training import resolve_train_config
from cse.storage.readers import read_senteval


def test_the_protocol_is_the_one_committed_before_its_runs():
    """Protocol 3 is fixed: an edit of PROTOCOL_V3 (or of the knobs and generator it takes from protocol 2) changes
    this hash, and records stored under the old one no longer count."""
    assert v3.protocol_hash() == "1cbd1ce15bcef184"
    assert v3.PROTOCOL_V3["rate"]["rule"] == v3.RATE_RULE and "constant guess" in v3.RATE_RULE


def _check(value, true_h, gap, constant=0.68):
    probe = {"true_h": true_h, "rolled_h": true_h + gap, "no_h": true_h, "gap": gap, "constant_guess": constant}
    return {"knob_value": value, "probe": probe}


@pytest.mark.parametrize("seed", range(20))
def test_the_rate_rule_never_picks_a_rate_whose_true_h_loss_is_above_the_constant_guess(seed):
    """Random checks, some above the constant guess with the largest gap of all: the rule's rate is admissible, has
    the largest gap among the admissible (within the tie) and, of those, the lowest true-h loss."""
    rng = np.random.default_rng(seed)
    checks = [_check(i, float(rng.uniform(0.55, 0.75)), float(rng.uniform(-0.01, 0.08))) for i in range(6)]
    checks.append(_check("trap", 0.70, 0.5))  # the largest gap, but worse than guessing
    chosen = v3.choose_rate(checks)
    fair = [c for c in checks if c["probe"]["true_h"] <= c["probe"]["constant_guess"]]
    if not fair:
        assert chosen is None
        return
    assert chosen["probe"]["true_h"] <= chosen["probe"]["constant_guess"] and chosen["knob_value"] != "trap"
    best = max(c["probe"]["gap"] for c in fair)
    assert chosen["probe"]["gap"] >= best - v3.PROTOCOL_V3["rate"]["tie"]
    tied = [c for c in fair if c["probe"]["gap"] >= best - v3.PROTOCOL_V3["rate"]["tie"]]
    assert chosen["probe"]["true_h"] == min(c["probe"]["true_h"] for c in tied)


def test_the_rate_rule_breaks_ties_by_the_lowest_true_h_loss_and_stops_without_an_admissible_rate():
    assert v3.choose_rate([_check("a", 0.60, 0.02), _check("b", 0.55, 0.01995)])["knob_value"] == "b"
    assert v3.choose_rate([_check("a", 0.60, 0.02), _check("b", 0.55, 0.0100)])["knob_value"] == "a"
    assert v3.choose_rate([_check("a", 0.70, 0.3), _check("b", 0.69, 0.1)]) is None


def test_on_protocol_2s_power_checks_the_rule_picks_neither_rate_protocol_2_ran_its_sts_at():
    """Applied to protocol 2's committed swap-task checks (the same task and steps), the rule picks D2CSE's 2e-3 and
    DiffCSE's 1e-4, not the last-listed rates (2e-4, 1e-3) whose true-h loss is above the constant guess."""
    report = json.loads((v3.REPO_ROOT / "benchmarks" / "results" / "evidence.json").read_text())["protocol_v2"]
    for method, want in (("d2cse", 2e-3), ("diffcse", 1e-4)):
        checks = [r for r in report["records"] if r["kind"] == "power" and r["method"] == method]
        assert v3.choose_rate(checks)["knob_value"] == want


def test_the_gate_power_and_trend():
    assert v3.control_passes([_check(1, 0.5, 0.01), _check(2, 0.5, 0.05)])
    assert not v3.control_passes([_check(1, 0.5, 0.049)])
    # (t(0.975, 5) + t(0.8, 5)) = 2.5706 + 0.9195: sd 1, six seeds
    assert v3.min_detectable([1.0, -1.0, 1.0, -1.0, 1.0, -1.0]) == pytest.approx(3.4901 * 1.0954 / 6**0.5, rel=1e-3)
    assert v3.min_detectable([0.3]) is None
    rising = v3.trend({s: [0.0, 1.0, 2.0, 3.0 + s / 10] for s in range(6)})
    assert rising["mean_slope"] > 0.9 and rising["p"] == pytest.approx(2 / 64)  # all six seeds the same sign
    assert v3.trend({0: [1.0, 0.0, 1.0, 0.0], 1: [0.0, 1.0, 0.0, 1.0]})["p"] == 1.0
    assert v3.dose_cells()[0] == (0.0, "reference") and len(v3.dose_cells()) == 7


def test_the_cpu_rehearsal_runs_every_stage_and_merge_refuses_it(tiny_bert_dir, tokenizer, senteval_head, tmp_path):
    """`run --steps 2` on CPU from a hand-made export (the tiny BERT, synthetic rows standing in for the swap task and
    the corruptions): the control and rate runs of every listed rate, then all seven dose cells of seed 0 at the
    rule's rate (a rehearsal passes the gates whatever they say), each record written; a rerun trains nothing; merge
    refuses the records (2 steps, not the protocol's)."""
    method = v3.METHODS[0]
    src = tmp_path / "export"
    ed.export_backbone(tiny_bert_dir, src / "backbone")
    cfg = resolve_train_config("smoke", {"max_length": 16, "batch_size": 4, "max_steps": 2}, method=method)
    rows, _ = synthetic_rows(cfg, method, 8, tokenizer)
    heldout = np.arange(4)
    ed.write_pickle(src / "rows.pkl.xz", {"rows": rows, "heldout_rows": rows, "heldout": heldout})
    swap = {"train_rows": rows, "all_rows": rows, "heldout": heldout, "real_rows": rows, "real_heldout": heldout}
    ed.write_pickle(src / "swap.pkl.xz", swap)
    ed.write_pickle(src / "sts.pkl.xz", read_senteval(senteval_head)[0])
    configs = {f"0-{c}": {"config": cfg.model_dump(mode="json"), "rows": "rows.pkl.xz"} for c in ("reference", "hard")}
    index = {"protocol": v3.protocol_hash(), "generator": None, "command": "export"}
    (src / "runs.json").write_text(
        json.dumps({**index, "methods": {method: {"swap": "swap.pkl.xz", "configs": configs}}})
    )
    home = tmp_path / "home"
    assert v3.run(src, home, "t", "cpu", [method], [0], steps=2, workers=1, command="run") == 0
    records = v3.parts(home).records()
    rates = v3.PROTOCOL_V3["knobs"][method][1]
    assert sorted(r["kind"] for r in records) == ["control"] * len(rates) + ["dose"] * 7 + ["rate"] * len(rates)
    assert all(r["steps"] == 2 and r["device"] == "cpu" for r in records)
    control = [r for r in records if r["kind"] == "control"]
    assert all(r["rtd_weight"] == 1.0 and {"probe", "real"} <= r.keys() for r in control)
    dose = [r for r in records if r["kind"] == "dose"]
    assert {(r["rtd_weight"], r["corruption"]) for r in dose} == set(v3.dose_cells())
    assert all(set(r["sts"]) == {*v3.SEVEN, "sts_avg"} and len(r["dev_curve"]) == 3 for r in dose)
    assert all(("mechanism" in r) == (r["rtd_weight"] > 0) for r in dose)
    assert len({r["knob_value"] for r in dose}) == 1  # every dose run at the one chosen rate
    assert v3.run(src, home, "t", "cpu", [method], [0], steps=2, workers=1) == 0  # done: nothing trains again
    assert len(v3.parts(home).records()) == len(records)
    lines = v3.report_lines(v3.summary(records))
    assert any(line.startswith(f"| {method} | 0.5 | hard | 1 |") for line in lines)
    with pytest.raises(SystemExit, match="shorter than the protocol"):
        v3.merge(home, tmp_path / "evidence.json", "merge", None)
    assert v2.protocol_hash() == "162efe38b9ce82b0"  # protocol 2 as it was
