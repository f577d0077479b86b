#!/usr/bin/env bash
# Build an offline wheelhouse: wheels of the project's dependencies except torch, for a target Python/platform.
#
#   bash scripts/wheelhouse.sh [--python 3.12] [--platform manylinux_2_28_x86_64] [--subset full|train]
#                              [--node-packages FILE] DIR
#
# Run it on a machine that reaches the package index (pip's own configuration is used). Defaults: CPython 3.12,
# manylinux x86_64 (glibc 2.17 … 2.39 tags), subset full. `--platform` may be repeated; the first one replaces the
# default list. `--subset train` keeps only what training and evaluation need (no Prefect, Dask, FastAPI, MLflow,
# psycopg: see scripts/offline_install.py); with `--node-packages FILE` (the node's `python -m pip freeze`, or bare
# names) it also leaves out what the node already has in a compatible version. The folder ends with
# wheelhouse.json (target, subset, wheels, size). Install on the node with `make install-offline WHEELHOUSE=DIR`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python_version=3.12 subset=full node_packages= out= platforms=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python_version="$2"; shift 2 ;;
    --platform) platforms+=("$2"); shift 2 ;;
    --subset) subset="$2"; shift 2 ;;
    --node-packages) node_packages="$2"; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "wheelhouse.sh: unknown option $1" >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "wheelhouse.sh: one output folder, got $out and $1" >&2; exit 2; }; out="$1"; shift ;;
  esac
done
[ -n "$out" ] || { echo "usage: wheelhouse.sh [options] DIR (see the header of $0)" >&2; exit 2; }
case "$subset" in full|train) ;; *) echo "wheelhouse.sh: --subset must be full or train, got $subset" >&2; exit 2 ;; esac
[ -z "$node_packages" ] || [ -f "$node_packages" ] || { echo "wheelhouse.sh: --node-packages $node_packages: no such file" >&2; exit 2; }
if [ ${#platforms[@]} -eq 0 ]; then
  platforms=(manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
  for n in 24 27 28 31 34 35 39; do platforms+=("manylinux_2_${n}_x86_64"); done
fi
PY="${PYTHON:-python3}"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out"
# pip resolves for the target (scripts/offline_install.py: torch counts as installed, so neither it nor its CUDA
# libraries are downloaded); resolving for another Python or platform needs pip >= 23.3: a throwaway venv gets one.
if ! "$PY" -c 'import sys, pip; sys.exit(tuple(map(int, pip.__version__.split(".")[:2])) < (23, 3))'; then
  "$PY" -m venv "$tmp/venv" && "$tmp/venv/bin/python" -m pip install -q -U 'pip>=23.3' && PY="$tmp/venv/bin/python"
fi
target=(--subset "$subset" --python-version "$python_version"); for p in "${platforms[@]}"; do target+=(--platform "$p"); done
echo "wheelhouse: resolving the $subset subset for CPython $python_version ${platforms[0]} …" >&2
"$PY" "$here/offline_install.py" download "$out" "${target[@]}"
installed=none; [ -z "$node_packages" ] || installed="$node_packages"
"$PY" "$here/offline_install.py" plan "$out" "${target[@]}" --installed "$installed" --prune --json "$tmp/plan.json" \
  --wheels >/dev/null
"$PY" - "$out" "$tmp/plan.json" "$python_version" "${platforms[0]}" <<'PYEOF'
import json, sys
from pathlib import Path
out, plan, py, plat = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), sys.argv[3], sys.argv[4]
wheels = sorted(out.glob("*.whl"))
size = sum(w.stat().st_size for w in wheels)
info = {"python": f"cp{py.replace('.', '')}", "platform": plat, "subset": plan["subset"], "wheels": len(wheels),
        "mib": round(size / 2**20, 1), "kept_from_node": plan["kept"], "never": plan["never"],
        "files": {w.name: round(w.stat().st_size / 2**20, 2) for w in wheels}}
(out / "wheelhouse.json").write_text(json.dumps(info, indent=2) + "\n")
print(f"wheelhouse {out}: {len(wheels)} wheels, {info['mib']} MiB (subset {plan['subset']}, CPython {py}, {plat})")
PYEOF
