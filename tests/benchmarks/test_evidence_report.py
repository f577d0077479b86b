"""benchmarks/evidence.py's bookkeeping (no training): paired method - control differences, mechanism figures, the
head-LR rows, resuming by cell, and the fixed protocol."""

from __future__ import annotations

import json

import pytest

from benchmarks import evidence as ev
from benchmarks import evidence_v2 as v2


def _cell(method, arm, seed, start, final, mechanism=None, losses=None):
    cell = {
        "method": method,
        "arm": arm,
        "label": arm,
        "seed": seed,
        "protocol": ev.protocol_hash(),
        "dev_curve": [[0, start], [100, (start + final) / 2], [200, final]],
        "start": start,
        "final": final,
        "delta": round(final - start, 2),
        "best": max(start, final),
        "learning_rate": 0.02,
        "losses": losses or [],
        "seconds": {"train_and_eval": 10.0},
    }
    if mechanism is not None:
        cell["mechanism"] = {
            c: {"loss": v, "accuracy": 0.9, "replaced_recall": 0.5}
            for c, v in zip(("true_h", "shuffled_h", "no_h"), mechanism)
        }
    return cell


def test_summary_pairs_each_control_with_the_method_by_seed():
    cells = [
        _cell("d2cse", "method", 0, 70.0, 72.0, (0.30, 0.34, 0.40)),
        _cell("d2cse", "method", 1, 70.0, 73.0, (0.32, 0.35, 0.41)),
        _cell("d2cse", "lambda0", 0, 70.0, 71.0),
        _cell("d2cse", "lambda0", 1, 70.0, 74.0),
    ]
    s = ev.summary({"cells": cells})["d2cse"]
    assert s["arms"]["method"]["delta"]["mean"] == pytest.approx(2.5)
    assert s["arms"]["method"]["delta"]["std"] == pytest.approx(0.7071, abs=1e-4)
    pair = s["method_minus_control"]["lambda0"]
    assert pair["mean"] == pytest.approx(0.0) and pair["method_better_in"] == 1 and pair["n"] == 2
    mech = s["arms"]["method"]["mechanism"]
    assert mech["true_h"]["loss"]["mean"] == pytest.approx(0.31) and mech["no_h"]["loss"]["mean"] == pytest.approx(
        0.405
    )
    assert "mechanism" not in s["arms"]["lambda0"]
    md = ev.markdown({"protocol": ev.protocol_hash(), "summary": ev.summary({"cells": cells}), "cells": cells})
    assert "| d2cse | control: lambda = 0 | 2 |" in md and "+0.00 ± 1.41 (method better in 1/2)" in md
    assert "| d2cse | D2CSE (lambda 0.005, conditioned) | 0.3100 ± 0.0141 | 0.3450 ± 0.0071 | 0.4050 ± 0.0071 |" in md
    assert "head learning rate" not in md  # no sensitivity cells yet


def test_head_lr_rows_read_the_first_contrastive_losses():
    losses = [{"step": s, "loss_contrastive": v} for s, v in ((1, 0.3), (2, 5.9), (3, 2.0), (11, 9.9))]
    base = _cell("d2cse", "method", 0, 70.0, 72.0, losses=losses)
    low = _cell("d2cse", "head-lr-0.002", 0, 70.0, 71.5, losses=[{"step": 1, "loss_contrastive": 0.3}])
    low["head_learning_rate"] = 0.002
    rows = ev.summary({"cells": [base, low]})["head_lr_sensitivity"]
    assert rows[0]["loss_step1"] == 0.3 and rows[0]["max_loss_1_10"] == 5.9  # step 11 is outside 1-10
    assert rows[0]["dev_at_50"] is None  # the fake curve has no step-50 point
    assert rows[1] == {"head_lr": "0.002", "loss_step1": 0.3, "max_loss_1_10": 0.3, "dev_at_50": 71.5}


def test_write_records_missing_cells_and_merge_refuses_another_protocol(tmp_path):
    out = tmp_path / "evidence.json"
    ev.write({"protocol": ev.protocol_hash(), "cells": [_cell("simcse", "method", 0, 80.0, 81.0)], "commands": []}, out)
    report = json.loads(out.read_text())
    assert ["simcse", "method", 1] in report["missing"] and not report["complete"]
    assert (tmp_path / "evidence_simcse.png").stat().st_size > 0 and out.with_suffix(".md").is_file()
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"protocol": "0" * 16, "cells": []}))
    with pytest.raises(SystemExit, match="protocol"):
        ev.merge([other], out, "merge")
    assert ev.load(out)["protocol"] == ev.protocol_hash()  # a report of this protocol resumes: its cells are skipped


def test_every_cell_of_the_protocol_is_planned():
    cells = ev.expected_cells()
    arms = sum(len(a) for a in ev.ARMS.values())
    assert len(cells) == arms * len(ev.PROTOCOL["seeds"]) + len(ev.PROTOCOL["head_lr_sensitivity"]["head_lrs"])
    assert ("d2cse", "ablation-c", 2) in cells and ("diffaug", "shared-prefix", 0) in cells


def test_the_protocol_hash_is_the_one_the_recorded_cells_were_run_under():
    """The arms, overrides and order now come from benchmarks/facts.py (keyed by method): they must still hash to the
    protocol every cell of benchmarks/results/evidence.json was run under."""
    assert ev.protocol_hash() == "0713ae7325e122a8"
    assert list(ev.ARMS) == ["simcse", "dcpcse", "d2cse", "diffcse", "diffaug"]
    assert ev.MECHANISM_ARMS == {("d2cse", "method"), ("d2cse", "ablation-c"), ("diffcse", "method")}
    assert ev.HEAD_LR_METHOD == "d2cse"
    order = ev.expected_cells()
    assert order[:3] == [("simcse", "method", s) for s in (0, 1, 2)] and order[-1] == ("diffaug", "shared-prefix", 2)
    assert [c for c in order if c[1].startswith("head-lr-")] == [
        ("d2cse", "head-lr-0.002", 0),
        ("d2cse", "head-lr-0.0002", 0),
    ]


def test_readme_table_pairs_by_seed_and_lists_every_control(tmp_path):
    cells = [
        _cell("simcse", "method", 0, 80.0, 82.0),
        _cell("simcse", "method", 1, 80.0, 83.0),
        _cell("simcse", "no-dropout", 0, 80.0, 81.0),
        _cell("simcse", "no-dropout", 1, 80.0, 81.0),
        _cell("diffaug", "method", 0, 20.0, 80.0),
    ]
    report = {"cells": cells, "missing": [list(c) for c in ev.expected_cells()][len(cells) :]}
    table = v2.readme_table(report)
    assert table.startswith(f"Protocol 1 (200 steps): measured 5 of its {len(ev.expected_cells())} cells (")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == sum(len(a) - 1 for a in ev.ARMS.values())  # a row per control, measured or not
    assert rows[0].startswith("| 1 | SimCSE")
    assert "| dropout 0 | 2 / 2 | +2.50 ± 0.71 | +1.00 ± 0.00 | +1.50 ± 0.71 (better in 2/2) |" in rows[0]
    diffaug = next(r for r in rows if r.startswith("| 1 | DiffAug"))
    assert diffaug.endswith("| 1 / 0 | +60.00 | – | – |")  # one seed states no spread; no control yet
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{v2.README_BEGIN}\nold numbers\n{v2.README_END}\n\nrest\n")
    v2.write_readme(report, readme)
    assert readme.read_text() == f"# x\n\n{v2.README_BEGIN}\n{table}\n{v2.README_END}\n\nrest\n"
    readme.write_text("# no block\n")
    with pytest.raises(SystemExit, match="no block"):
        v2.write_readme(report, readme)


def test_the_readme_states_the_committed_evidence():
    """README's evidence table is the rendering of benchmarks/results/evidence.json, not numbers typed by hand."""
    report = json.loads((ev.REPO_ROOT / "benchmarks" / "results" / "evidence.json").read_text())
    readme = (ev.REPO_ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split(v2.README_BEGIN, 1)[1].split(v2.README_END, 1)[0]
    assert block.strip() == v2.readme_table(report), "rerun python -m benchmarks.evidence --report --readme README.md"


def test_a_recorded_command_names_paths_relative_to_the_checkout():
    """Every benchmark records its command through `benchmarks.machine.command_line`: a path inside the checkout or
    the shared data is written relative to the checkout, in `--opt value` and `--opt=value` forms alike."""
    from benchmarks.machine import REPO_ROOT, command_line

    argv = [
        "--out",
        str(REPO_ROOT / "benchmarks" / "x.json"),
        f"--data={REPO_ROOT.parent / 'shared' / 'data'}",
        "-n",
        "3",
    ]
    assert command_line("benchmarks.learning", argv) == (
        "python -m benchmarks.learning --out benchmarks/x.json --data=../shared/data -n 3"
    )
