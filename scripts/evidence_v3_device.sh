#!/bin/sh
# Protocol 3 (benchmarks/evidence_v3.py) on the device machine: every stage, up to WORKERS runs at a time on one GPU,
# each record written into $OUT/evidence-v3/parts/gpu.json as it ends (a rerun resumes), stopped by the protocol's
# device budget (540 s; `timeout` 560 s guards it). Before it, on this machine (CPU, the data stages, hours):
#     python -m benchmarks.evidence_v3 export --dest .cse/evidence-v3-export
# and there `make install-offline` (docs/gpu.md; the wheelhouse travels in a call of its own: carry limit 64 MiB).
# Then, the export carried (`du -sh` it first), here: sh scripts/evidence_v3_device.sh .cse/evidence-v3-export
# and back here: python -m benchmarks.evidence_v3 merge --home <files_at>/evidence-v3 --docs docs/evidence.md
# CPU rehearsal (its records are refused by merge): DEVICE=cpu STEPS=2 SEEDS=0 WORKERS=2 sh scripts/evidence_v3_device.sh DIR
set -eu
src=${1:?usage: scripts/evidence_v3_device.sh EXPORT_DIR}
out=${OUT:-.cse/evidence-v3-device}
python=${PYTHON:-.venv/bin/python}
[ "${DEVICE:-cuda}" = cuda ] && { nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true; }
timeout 560 "$python" -m benchmarks.evidence_v3 run --src "$src" --home "$out/evidence-v3" \
  --state "${TMPDIR:-/tmp}/evidence-v3-state" --device "${DEVICE:-cuda}" --workers "${WORKERS:-12}" --threads 1 \
  --part gpu ${STEPS:+--steps "$STEPS"} ${SEEDS:+--seeds "$SEEDS"}
