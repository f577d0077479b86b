"""Files written before the packages moved under `cse` (tests/fixtures/pre_rename/, written by the code of that time)
load with the renamed code: a checkpoint as it is (it records the method's name, not a module path), a pyfunc model
logged to MLflow and a `project` sentence-transformers export through `cse.ops.legacy.legacy_module_names` (they
name a class by its old module path)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cse.models.checkpoint import META_FILE, load_checkpoint
from cse.models.export.st_export import export_sentence_transformer
from cse.ops.legacy import LEGACY_PACKAGES, legacy_module_names

FIXTURE = Path(__file__).parent / "fixtures" / "pre_rename"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


def _embed(model, sentences):
    enc = model.tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.inference_mode():
        return model.embed(enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids"))


def _relocated_checkpoint(folder: Path, backbone: Path) -> Path:
    """The fixture's checkpoint copied to `folder`, its backbone path (a temporary folder of the machine that wrote it)
    pointed at the same tiny BERT rebuilt by tests/conftest.py: what `backbone_override` does when loading."""
    shutil.copytree(FIXTURE / "d2cse", folder)
    meta = json.loads((folder / META_FILE).read_text())
    meta["backbone"] = meta["model_config"]["backbone"] = str(backbone)
    (folder / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return folder


def test_a_checkpoint_written_before_the_rename_loads_and_embeds_as_it_did(tiny_bert_dir):
    meta = json.loads((FIXTURE / "d2cse" / META_FILE).read_text())
    assert meta["method"] == "d2cse"
    model = load_checkpoint(FIXTURE / "d2cse", backbone_override=str(tiny_bert_dir))
    assert type(model).__module__ == "cse.models.methods.d2cse"
    torch.testing.assert_close(
        _embed(model, EXPECTED["sentences"]), torch.tensor(EXPECTED["embeddings"]), rtol=1e-5, atol=1e-6
    )


# A child with cwd = a temp dir and PYTHONPATH unset: the old top-level names are not importable there (an editable
# install puts the checkout's root on the import path, where each folder refuses its bare name: cse/__init__.py).
_CHILD = textwrap.dedent(
    """
    import importlib, json, sys

    import mlflow
    from sentence_transformers.util.misc import import_module_class

    from cse.ops.legacy import LEGACY_PACKAGES, legacy_module_names

    pyfunc, export, sentences = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    for name in LEGACY_PACKAGES:  # not found (a regular install), or refused (cse/__init__.py: an editable one)
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        raise SystemExit(f"the old name {name!r} imports outside the checkout")
    out = {}
    try:
        mlflow.pyfunc.load_model(pyfunc)
    except ImportError as e:
        out["pyfunc_without"] = str(e)
    with legacy_module_names():
        model = mlflow.pyfunc.load_model(pyfunc)
    out["embeddings"] = model.predict(sentences).tolist()
    out["class"] = type(model.unwrap_python_model()).__module__
    ref = json.loads(open(export + "/modules.json").read())[0]["type"]
    try:
        import_module_class(ref, export, trust_remote_code=True)
    except ImportError as e:
        out["export_without"] = str(e)
    with legacy_module_names():
        out["export_class"] = import_module_class(ref, export, trust_remote_code=True).__module__
    # the path an export written after the rename but before models/ was sorted by role names (issue 36)
    moved = "cse.models.st_export.PromptedEncoderModule"
    try:
        import_module_class(moved, export, trust_remote_code=True)
    except ImportError as e:
        out["moved_without"] = str(e)
    with legacy_module_names():
        out["moved_class"] = import_module_class(moved, export, trust_remote_code=True).__module__
    out["moved_leaked"] = sorted(m for m in sys.modules if m == "cse.models.st_export")
    out["leaked"] = sorted(m for m in sys.modules if m.split(".")[0] in LEGACY_PACKAGES)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def loaded_outside_the_checkout(tiny_bert_dir, tmp_path_factory) -> dict:
    """The pyfunc fixture (its checkpoint artifact put back) and a `project` export whose `modules.json` names the
    class as an export written before the rename did, loaded in a child without and with `legacy_module_names`."""
    root = tmp_path_factory.mktemp("pre_rename")
    pyfunc = root / "pyfunc"
    shutil.copytree(FIXTURE / "pyfunc", pyfunc)
    checkpoint = _relocated_checkpoint(pyfunc / "artifacts" / "d2cse", tiny_bert_dir)
    export = export_sentence_transformer(checkpoint, root / "export")
    modules = json.loads((export / "modules.json").read_text())
    assert modules[0]["type"] == "cse.models.export.st_export.PromptedEncoderModule"
    modules[0]["type"] = "models.st_export.PromptedEncoderModule"
    (export / "modules.json").write_text(json.dumps(modules, indent=2))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, str(pyfunc), str(export), json.dumps(EXPECTED["sentences"])],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_fixtures_pyfunc_pickle_names_the_old_module():
    pickled = (FIXTURE / "pyfunc" / "python_model.pkl").read_bytes()
    assert b"tracking.model_export" in pickled and b"cse." not in pickled


def test_a_pyfunc_model_logged_before_the_rename_loads_with_the_legacy_names(loaded_outside_the_checkout):
    found = loaded_outside_the_checkout
    without = found["pyfunc_without"]
    assert "No module named 'tracking'" in without or "import cse.tracking, not tracking" in without
    assert found["class"] == "cse.tracking.model_export"
    torch.testing.assert_close(
        torch.tensor(found["embeddings"]), torch.tensor(EXPECTED["embeddings"]), rtol=1e-5, atol=1e-6
    )
    assert found["leaked"] == [], "legacy_module_names left old module names behind"


def test_a_project_export_written_before_the_rename_loads_with_the_legacy_names(loaded_outside_the_checkout):
    found = loaded_outside_the_checkout
    assert "models" in found["export_without"]
    assert found["export_class"] == "cse.models.export.st_export"
    assert found["leaked"] == []


def test_a_project_export_written_before_models_was_sorted_by_role_loads_with_the_legacy_names(
    loaded_outside_the_checkout,
):
    """Issue 36 moved cse.models.st_export to cse.models.export.st_export: an export naming the former loads."""
    found = loaded_outside_the_checkout
    assert "cse.models.st_export" in found["moved_without"]
    assert found["moved_class"] == "cse.models.export.st_export"
    assert found["moved_leaked"] == []


def test_every_module_moved_by_issue_36_resolves_under_its_old_names():
    """The methods, the exports and the split prefix module, by their `models.<name>` and `cse.models.<name>` paths,
    within `legacy_module_names` (a pickle or an export naming one of their classes finds it), and not after it."""
    from cse.models.export.st_export import PromptedEncoderModule
    from cse.models.methods.d2cse import D2CSE
    from cse.models.prompts.backbone import PromptedBackbone
    from cse.models.prompts.prefixes import PrefixEncoder

    with legacy_module_names():
        for root in ("models", "cse.models"):
            assert importlib.import_module(f"{root}.d2cse").D2CSE is D2CSE
            assert importlib.import_module(f"{root}.st_export").PromptedEncoderModule is PromptedEncoderModule
            prefix = importlib.import_module(f"{root}.prefix")
            assert prefix.PrefixEncoder is PrefixEncoder and prefix.PromptedBackbone is PromptedBackbone
    assert not {"models.d2cse", "cse.models.d2cse", "cse.models.prefix"} & set(sys.modules)
    assert not hasattr(sys.modules["cse.models"], "d2cse")


def test_the_legacy_names_are_the_old_top_level_packages():
    assert set(LEGACY_PACKAGES) == {
        p.name for p in Path(__file__).parents[1].iterdir() if (p / "__init__.py").is_file() and p.name != "tests"
    } - {"cse"}
