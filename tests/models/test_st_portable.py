"""The portable sentence-transformers export (models/export/st_export.py `export_portable_sentence_transformer`): a plain
trained encoder becomes stock Transformer + Pooling modules, a prompt method (D2CSE) ships its module's code
(models/export/st_prompted.py) in the folder; both load in a subprocess where this project is not importable and embed as the
training code does."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cse.config.methods import build_model
from cse.models.checkpoint import load_checkpoint, save_checkpoint
from cse.models.export import st_prompted
from cse.models.export.st_export import (
    CHECKPOINT_SUBDIR,
    STExport,
    export_kind,
    export_portable_sentence_transformer,
)
from tests.models.test_st_export import _embed

SENTENCES = ["a woman is slicing an onion .", "two dogs run on the beach today"]

# Run in a child with cwd = a temp dir and PYTHONPATH unset, where a finder placed first on sys.meta_path refuses
# the project's package `cse` and the old top-level names (however they would be found: an editable or a regular
# install, the repository root): `import cse` and `import models` must fail there first, then the export loads with
# sentence-transformers + torch + transformers only.
_CHILD = textwrap.dedent(
    """
    import importlib.abc, json, sys
    PROJECT = ("cse", "models", "config", "storage", "tracking")

    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in PROJECT:
                raise ModuleNotFoundError(f"No module named {name!r} (refused: the project is not installed here)")
            return None

    sys.meta_path.insert(0, NotInstalled())
    for name in PROJECT:
        try:
            __import__(name)
        except ImportError:
            continue
        raise SystemExit(f"the project's package {name!r} is importable in the child: the test would prove nothing")
    from sentence_transformers import SentenceTransformer
    out = {}
    for name, (folder, trust) in json.loads(sys.argv[1]).items():
        model = SentenceTransformer(folder, trust_remote_code=trust, device="cpu")
        out[name] = model.encode(json.loads(sys.argv[2]), convert_to_numpy=True).tolist()
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in PROJECT)
    print(json.dumps({"embeddings": out, "leaked": leaked}))
    """
)


def _load_outside_the_project(folders: dict[str, tuple[Path, bool]], tmp_path: Path) -> dict[str, torch.Tensor]:
    """Each `name: (export folder, trust_remote_code)` loaded and encoding `SENTENCES` in one child process."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CSE_HOME")}
    env["HF_HOME"] = str(tmp_path / "hf_home")  # transformers copies the folder's module code under HF_MODULES_CACHE
    env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
    spec = {name: [str(folder), trust] for name, (folder, trust) in folders.items()}
    args = [json.dumps(spec), json.dumps(SENTENCES)]
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["leaked"] == []
    return {name: torch.tensor(v) for name, v in found["embeddings"].items()}


def _checkpoint(method: str, tiny_bert_dir, folder, **config):
    """A checkpoint whose trainable tensors moved away from their initial values (a wrong export would show)."""
    torch.manual_seed(0)
    model = build_model(method, {"backbone": str(tiny_bert_dir), **config}).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return save_checkpoint(model, folder)


@pytest.fixture(scope="module")
def checkpoints(tiny_bert_dir, tmp_path_factory):
    """A prompt method with a [CLS] prompt (D2CSE) and a plain trained encoder (SimCSE)."""
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "d2cse": _checkpoint("d2cse", tiny_bert_dir, root / "d2cse", prefix_len=3, cls_prompt=True),
        "simcse": _checkpoint("simcse", tiny_bert_dir, root / "simcse"),
    }


def test_exports_load_without_the_project_and_embed_as_training(checkpoints, tokenizer, tmp_path):
    prompted = export_portable_sentence_transformer(checkpoints["d2cse"], tmp_path / "d2cse")
    assert isinstance(prompted, STExport) and prompted.kind == "bundled-code" and prompted.trust_remote_code
    assert prompted.max_abs_diff is not None and prompted.max_abs_diff <= 1e-5, prompted.reason
    out = prompted.folder
    assert not (out / CHECKPOINT_SUBDIR).exists()
    modules = json.loads((out / "modules.json").read_text())
    assert modules == [{"idx": 0, "name": "0", "path": "", "type": "cse_prompted_encoder.PromptedEncoder"}]
    assert (out / st_prompted.CODE_FILE).read_text() == Path(st_prompted.__file__).read_text()
    spec = json.loads((out / st_prompted.SPEC_FILE).read_text())
    # the tiny backbone is a local folder: it travels in the export, named relatively
    assert spec["base_model"] == "encoder" and (out / "encoder" / "config.json").is_file()
    assert str(tmp_path) not in json.dumps(spec) and spec["pooling"] == {"kind": "cls"}
    assert export_kind(out) == STExport(out, "bundled-code", f"the module's code ships as {st_prompted.CODE_FILE}")

    plain = export_portable_sentence_transformer(checkpoints["simcse"], tmp_path / "simcse")
    assert plain.kind == "standard" and not plain.trust_remote_code
    types = [m["type"] for m in json.loads((plain.folder / "modules.json").read_text())]
    assert types[0].startswith("sentence_transformers.") and types[0].endswith(".Transformer")
    assert all(t.startswith("sentence_transformers.") for t in types) and export_kind(plain.folder).kind == "standard"

    # `bundle_base=False` (a hub backbone): the base is named, not copied; the [CLS] prompt folded into a position row
    # travels as `base.embeddings.position_embeddings.weight` and is applied on load
    named = export_portable_sentence_transformer(checkpoints["d2cse"], tmp_path / "named", bundle_base=False).folder
    spec = json.loads((named / st_prompted.SPEC_FILE).read_text())
    assert not (named / "encoder").exists() and spec["overrides"] == ["embeddings.position_embeddings.weight"]
    assert Path(spec["base_model"]).name == Path(load_checkpoint(checkpoints["d2cse"]).config.backbone).name

    folders = {"d2cse": (out, True), "simcse": (plain.folder, False), "named": (named, True)}
    got = _load_outside_the_project(folders, tmp_path)
    for name, method in (("d2cse", "d2cse"), ("simcse", "simcse"), ("named", "d2cse")):
        want = _embed(load_checkpoint(checkpoints[method]), tokenizer, SENTENCES)
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-5)


def test_the_bundled_module_imports_nothing_from_the_project():
    tree = ast.parse(Path(st_prompted.__file__).read_text())
    roots = {
        (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in (n.names if isinstance(n, ast.Import) else [n])
        if not isinstance(n, ast.ImportFrom) or n.level == 0
    }
    assert roots <= {
        "__future__",
        "collections",
        "json",
        "pathlib",
        "typing",
        "torch",
        "safetensors",
        "sentence_transformers",
        "transformers",
    }


def test_a_failed_check_falls_back_to_the_project_module(checkpoints, tmp_path, monkeypatch):
    """A check that fails (here: an impossible tolerance) leaves the in-project form, with the reason."""
    import cse.models.export.st_export as st_export

    monkeypatch.setattr(st_export, "TOLERANCE", -1.0)
    result = export_portable_sentence_transformer(checkpoints["d2cse"], tmp_path / "export", probe_sentences=("a b",))
    assert result.kind == "project" and "differs from the training code's embeddings" in result.reason
    modules = json.loads((tmp_path / "export" / "modules.json").read_text())
    assert modules[0]["type"] == "cse.models.export.st_export.PromptedEncoderModule" and result.trust_remote_code
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob("*.previous"))


def test_an_export_stopped_midway_leaves_the_earlier_export_whole(checkpoints, tmp_path, monkeypatch):
    """The export is written through `atomic_dir`: stopped while its last form is written (an interrupt in the
    project form's save), the earlier export is still there, file for file, and no temporary folder is left."""
    import cse.models.export.st_export as st_export

    out = tmp_path / "export"
    monkeypatch.setattr(st_export, "TOLERANCE", -1.0)  # straight to the project form, the cheapest
    export_portable_sentence_transformer(checkpoints["d2cse"], out, probe_sentences=("a b",))
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    def interrupted(module, folder: Path) -> None:
        (folder / "modules.json").write_text("[]")  # half a folder
        raise KeyboardInterrupt

    monkeypatch.setattr(st_export, "_save_project_module", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_portable_sentence_transformer(checkpoints["d2cse"], out, probe_sentences=("a b",))
    assert {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_exporting_onto_the_checkpoint_is_refused(checkpoints):
    with pytest.raises(ValueError, match="overwrite the checkpoint"):
        export_portable_sentence_transformer(checkpoints["d2cse"], checkpoints["d2cse"].parent)
