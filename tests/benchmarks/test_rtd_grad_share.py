"""benchmarks/rtd_grad_share.py: every CRTD preset measured, one record of the smoke preset (real MiniLM), the table."""

from __future__ import annotations

import json

from benchmarks import rtd_grad_share as gs
from cse.config.methods import REGISTRY
from cse.config.presets import PRESETS
from cse.models.methods.crtd import ConditionalRTDModel


def test_every_preset_of_every_crtd_method_is_measured_and_the_committed_table_has_them():
    crtd = [s.name for s in REGISTRY.values() if issubclass(s.model_class, ConditionalRTDModel)]
    assert gs.crtd_presets() == [(m, p) for m in crtd for p in PRESETS[m]] and len(crtd) == 2
    committed = json.loads((gs.OUT / "rtd_grad_share.json").read_text())
    assert [(r["method"], r["preset"]) for r in committed["records"]] == gs.crtd_presets()
    assert gs.markdown(committed["records"], committed["command"]) == (gs.OUT / "rtd_grad_share.md").read_text()


def test_a_record_holds_the_share_of_each_group_both_losses_reach():
    method, preset = next(p for p in gs.crtd_presets() if p[1] == "smoke")
    rec = gs.measure(method, preset, rows=4)
    assert rec["weights"] == "packaged" and rec["rows"] == 4 and rec["rtd_weight"] > 0
    assert {k.split("_", 1)[0] for k in rec["shares"]} == {"share", "norm"}
    assert all(0 < v < 1 for k, v in rec["shares"].items() if k.startswith("share"))
