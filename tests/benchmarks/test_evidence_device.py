"""benchmarks/evidence_device.py: protocol 2's STS runs carried to a machine without the data stages (the backbone
rounded to fp16 and restored as fp32, the runs trained from an export and recorded as a GPU-or-other device's set)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from benchmarks import evidence_device as ed
from benchmarks import evidence_v2 as v2
from benchmarks.gpu_check import synthetic_rows
from cse.config.training import resolve_train_config
from cse.storage.readers import read_senteval


def test_the_backbone_travels_as_fp16_and_comes_back_as_fp32(tiny_bert_dir, tmp_path):
    ed.export_backbone(tiny_bert_dir, tmp_path / "backbone")
    half = load_file(str(tmp_path / "backbone" / ed.HALF))
    assert {t.dtype for t in half.values() if t.is_floating_point()} == {torch.float16}
    full = ed.restore_backbone(tmp_path / "backbone")
    assert (
        full == tmp_path / "backbone-fp32" and (full / "config.json").is_file() and (full / "tokenizer.json").is_file()
    )
    original, restored = load_file(str(tiny_bert_dir / "model.safetensors")), load_file(str(full / "model.safetensors"))
    assert original.keys() == restored.keys()
    for k, v in original.items():
        assert restored[k].dtype == v.dtype  # fp32 again, each value the fp16 rounding of the original
        assert torch.equal(restored[k], v.half().to(v.dtype) if v.is_floating_point() else v)
    assert ed.restore_backbone(tmp_path / "backbone") == full  # made once


def test_an_exported_run_trains_on_the_device_and_is_recorded_as_its_set(
    tiny_bert_dir, tokenizer, senteval_head, tmp_path
):
    src = tmp_path / "export"
    ed.export_backbone(tiny_bert_dir, src / "backbone")
    method, arm = next(iter(v2.ARMS.items()))
    cfg = resolve_train_config("smoke", {"max_length": 16, "batch_size": 4, "max_steps": 2}, method=method)
    rows, _ = synthetic_rows(cfg, method, 8, tokenizer)
    ed.write_pickle(src / "rows-x.pkl.xz", {"rows": rows, "heldout_rows": rows, "heldout": np.arange(4)})
    ed.write_pickle(src / "sts.pkl.xz", read_senteval(senteval_head)[0])
    fields = v2.sts_fields(method, arm[0], 0, None, False, "x")
    runs = [{"fields": fields, "trains_rtd": True, "config": cfg.model_dump(mode="json"), "rows": "rows-x.pkl.xz"}]
    index = {"protocol": v2.protocol_hash(), "generator": None, "runs": runs, "command": "export"}
    (src / "runs.json").write_text(json.dumps(index))
    home = tmp_path / "home"
    assert ed.run(src, home, "t", "cpu", [], None, steps=2, command="run") == 0
    part = json.loads((home / "parts" / "t.json").read_text())
    (rec,) = part["records"]
    assert rec["device"] == "cpu" and rec["steps"] == 2 and rec["method"] == method and rec["arm"] == arm[0].name
    assert [s for s, _ in rec["dev_curve"]] == [0, 1, 2] and set(rec["mechanism"]) >= {"true_h", "rolled_h", "no_h"}
    assert part["commands"] == ["export", "run"] and part["environment"]["device"] == "cpu"
    assert ed.run(src, home, "t", "cpu", [], None, steps=2) == 0  # done: nothing trains again
    assert len(json.loads((home / "parts" / "t.json").read_text())["records"]) == 1
    with pytest.raises(SystemExit, match="shorter than the protocol"):  # a rehearsal never reaches the report
        v2.merge(home, tmp_path / "evidence.json", "merge", None, None)
