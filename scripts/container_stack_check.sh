#!/usr/bin/env bash
# The slower check of the container images and docker/compose.yaml (run before resolving; the native stack's
# counterpart is tests/ops/test_team_stack.py). With podman:
#   1. a Debian bookworm base image: `debootstrap --variant=minbase` + `podman import` (cached as $BASE_IMAGE)
#   2. the CPU image (docker/Dockerfile) and the local PostgreSQL image (docker/Dockerfile.postgres) on that base;
#      docker/Dockerfile.gpu must differ from docker/Dockerfile only in its header and base/torch defaults (not built)
#   3. the compose stack with podman-compose (PyPI, in a throwaway venv under $WORK): postgres, prefect-server,
#      prefect-setup (pools, `prefect deploy --all` inside a container), mlflow-server, three worker containers
#      of one slot each (CSE_WORKER_LIMIT=1)
#   4. a smoke sweep of two children dispatched as deployment runs (`prefect deployment run sweep/smoke`): the
#      parent holds one worker's only slot, so the two children must fan out to the two other worker containers
#   5. checks: the sweep and both children COMPLETED; MLflow holds the parent and both children (FINISHED, with
#      best_stsb_dev), trained on two different workers (MLflow tag `worker` = CSE_WORKER_NAME); both servers store in
#      PostgreSQL; the published ports listen on 127.0.0.1 only
#   6. teardown, always (trap): containers, pod, network and volumes of the check's compose project
# Prints the timings (image build, image size, stack up, sweep).
#
# Facts of the machines this runs on (README "Running for a team"): containers start only with the runc runtime
# and with podman's default ulimits emptied (a containers.conf, selected with CONTAINERS_CONF); no registry can be
# pulled from (hence the local base); builds need --network host; pip in a build trusts the machine's CA bundle,
# mounted at a side path with PIP_CERT pointing at it (mounted over /etc/ssl/certs/ca-certificates.crt it breaks
# apt); PyPI's torch is a CUDA build, so the CPU wheel comes from $CSE_WHEELS (find-links, mounted at build time).
#
# | variable | default |
# |---|---|
# | CSE_CONTAINER_WORK | /var/tmp/cse-podman (rootfs, build context, podman-compose venv, containers.conf) |
# | CSE_DEBIAN_MIRROR | the first deb.debian.org-style URI of this machine's apt sources, else http://deb.debian.org/debian |
# | CSE_BASE_IMAGE | localhost/cse-bookworm:base |
# | CSE_IMAGE / CSE_POSTGRES_IMAGE | localhost/cse-pipeline:cpu / localhost/cse-postgres:15 |
# | CSE_WHEELS | /opt/wheels (holds torch-2.13.0+cpu; TORCH_SPEC torch==2.13.0+cpu from there, else PyPI's torch==2.13.0) |
# | CSE_CA_BUNDLE | /etc/ssl/certs/ca-certificates.crt |
# | CSE_DATA_MIRROR | ../shared/data beside the checkout (mounted read-only at /shared/data) |
# | CSE_CHECK_PROJECT | cse-check (the compose project: container, volume and network names) |
# | CSE_CHECK_TIMEOUT | 900 seconds for the sweep |
# | CSE_CHECK_KEEP=1 | leave the stack running (no teardown) |
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

WORK="${CSE_CONTAINER_WORK:-/var/tmp/cse-podman}"
BASE_IMAGE="${CSE_BASE_IMAGE:-localhost/cse-bookworm:base}"
IMAGE="${CSE_IMAGE:-localhost/cse-pipeline:cpu}"
PG_IMAGE="${CSE_POSTGRES_IMAGE:-localhost/cse-postgres:15}"
WHEELS="${CSE_WHEELS:-/opt/wheels}"
CA_BUNDLE="${CSE_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
PROJECT="${CSE_CHECK_PROJECT:-cse-check}"
SWEEP_TIMEOUT="${CSE_CHECK_TIMEOUT:-900}"
NICE=(nice -n 19 ionice -c3)   # the machine is shared: every heavy step at the lowest priority
mkdir -p "$WORK/conf"

log() { printf '\n=== %s  %s\n' "$(date +%T)" "$*"; }
die() { echo "container_stack_check: $*" >&2; exit 1; }
declare -A T=([base]=cached)  # timings

# --- podman and its configuration ---------------------------------------------------------------------------
need=()
for tool in podman runc debootstrap; do command -v "$tool" >/dev/null || need+=("$tool"); done
if [ "${#need[@]}" -gt 0 ]; then
  log "installing ${need[*]}"
  "${NICE[@]}" apt-get install -y podman runc debootstrap
fi
cat >"$WORK/conf/containers.conf" <<'EOF'
[containers]
default_ulimits = []

[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF="$WORK/conf/containers.conf"
podman info >/dev/null || die "podman does not work"

# --- 1. base image: Debian bookworm from debootstrap -----------------------------------------------------------
debian_mirror() {
  local uri
  uri="$( { grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}'
            grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}'; } \
          | grep -E '/debian/?$' | head -n 1)"
  echo "${uri:-http://deb.debian.org/debian}"
}
if ! podman image exists "$BASE_IMAGE"; then
  mirror="${CSE_DEBIAN_MIRROR:-$(debian_mirror)}"
  log "debootstrap bookworm from $mirror"
  rm -rf "$WORK/rootfs"
  t0=$SECONDS
  "${NICE[@]}" debootstrap --variant=minbase bookworm "$WORK/rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -n 30 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
  rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
  tar -C "$WORK/rootfs" -c . | "${NICE[@]}" podman import - "$BASE_IMAGE" >/dev/null
  rm -rf "$WORK/rootfs"
  T[base]="$((SECONDS - t0))s"
fi

# --- 2. images ----------------------------------------------------------------------------------------------
# the GPU Dockerfile is the CPU one with other defaults: nothing else may differ
strip() { grep -v -E '^#|^ARG (BASE_IMAGE|TORCH_INDEX)=' "$1"; }
diff <(strip docker/Dockerfile) <(strip docker/Dockerfile.gpu) >/dev/null \
  || { diff <(strip docker/Dockerfile) <(strip docker/Dockerfile.gpu) >&2; die "docker/Dockerfile.gpu differs from docker/Dockerfile beyond its base/torch defaults"; }

# the build context: the checkout's tracked and not ignored files (no .venv, no .cse)
log "build context"
rm -rf "$WORK/context"; mkdir -p "$WORK/context"
git ls-files -z -c -o --exclude-standard | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
  | tar --null -T - -c | tar -x -C "$WORK/context"

torch_args=()
if ls "$WHEELS"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  torch_args=(-v "$WHEELS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels
              --build-arg TORCH_SPEC=torch==2.13.0+cpu --build-arg TORCH_INDEX=https://pypi.org/simple)
fi
ca_args=()
if [ -s "$CA_BUNDLE" ]; then ca_args=(-v "$CA_BUNDLE:/tmp/host-ca.crt:ro" --build-arg PIP_CERT=/tmp/host-ca.crt); fi

log "building $IMAGE"
t0=$SECONDS
"${NICE[@]}" podman build --network host -f "$WORK/context/docker/Dockerfile" --build-arg BASE_IMAGE="$BASE_IMAGE" \
  "${ca_args[@]}" "${torch_args[@]}" -t "$IMAGE" "$WORK/context" >"$WORK/build-cpu.log" 2>&1 \
  || { tail -n 40 "$WORK/build-cpu.log" >&2; die "building $IMAGE failed (log: $WORK/build-cpu.log)"; }
T[build_cpu]=$((SECONDS - t0))
log "building $PG_IMAGE"
t0=$SECONDS
"${NICE[@]}" podman build --network host -f "$WORK/context/docker/Dockerfile.postgres" --build-arg BASE_IMAGE="$BASE_IMAGE" \
  -t "$PG_IMAGE" "$WORK/context" >"$WORK/build-pg.log" 2>&1 \
  || { tail -n 40 "$WORK/build-pg.log" >&2; die "building $PG_IMAGE failed (log: $WORK/build-pg.log)"; }
T[build_pg]=$((SECONDS - t0))
size() { podman image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }

# --- 3. the compose stack -----------------------------------------------------------------------------------
if podman compose version >/dev/null 2>&1; then
  COMPOSE=(podman compose)
else
  if [ ! -x "$WORK/compose-venv/bin/podman-compose" ]; then
    log "podman-compose into $WORK/compose-venv"
    python3 -m venv "$WORK/compose-venv"
    "${NICE[@]}" "$WORK/compose-venv/bin/pip" install -q "podman-compose==1.6.0"
  fi
  COMPOSE=("$WORK/compose-venv/bin/podman-compose")
fi
COMPOSE+=(-f "$REPO/docker/compose.yaml" -p "$PROJECT")

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# the check's own settings (never 4200 / 5000: another stack may use them); they override docker/.env
export CSE_IMAGE="$IMAGE" CSE_POSTGRES_IMAGE="$PG_IMAGE" CSE_PUBLISH_ADDR=127.0.0.1
export CSE_PG_PASSWORD; CSE_PG_PASSWORD="$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')"
export CSE_PG_PORT; CSE_PG_PORT="$(free_port)"
export CSE_PREFECT_PORT; CSE_PREFECT_PORT="$(free_port)"
export CSE_MLFLOW_PORT; CSE_MLFLOW_PORT="$(free_port)"
export CSE_MLFLOW_WORKERS=1 CSE_WORKER_LIMIT=1 CSE_WORKER_PREFIX=check PREFECT_UI_ENABLED=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PREFECT_WORKER_QUERY_SECONDS=3
export CSE_DATA_MIRROR="${CSE_DATA_MIRROR:-$(cd "$REPO/.." && pwd)/shared/data}"
[ -d "$CSE_DATA_MIRROR" ] || die "no data mirror at $CSE_DATA_MIRROR (CSE_DATA_MIRROR)"

teardown() {
  local rc=$?
  if [ "${CSE_CHECK_KEEP:-0}" = 1 ]; then echo "CSE_CHECK_KEEP=1: the stack keeps running (${COMPOSE[*]} down -v)"; return; fi
  log "teardown"
  "${COMPOSE[@]}" down -v -t 10 >"$WORK/down.log" 2>&1 || true
  # whatever podman-compose left behind (a failed `up`): by the compose labels
  local ids
  ids="$(podman ps -aq --filter "label=io.podman.compose.project=$PROJECT")"
  [ -z "$ids" ] || podman rm -f -t 5 $ids >/dev/null 2>&1 || true
  podman pod rm -f "pod_$PROJECT" >/dev/null 2>&1 || true
  for v in $(podman volume ls -q --filter "label=io.podman.compose.project=$PROJECT"); do podman volume rm -f "$v" >/dev/null || true; done
  podman network rm -f "${PROJECT}_default" >/dev/null 2>&1 || true
  left="$(podman ps -aq --filter "label=io.podman.compose.project=$PROJECT")"
  [ -z "$left" ] || { echo "container_stack_check: containers left: $left" >&2; rc=1; }
  exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM

log "compose up (${COMPOSE[0]##*/})"
"${COMPOSE[@]}" down -v -t 5 >/dev/null 2>&1 || true   # a previous run's leftovers
t0=$SECONDS
"${COMPOSE[@]}" up -d --scale worker=3 >"$WORK/up.log" 2>&1 || { tail -n 40 "$WORK/up.log" >&2; die "compose up failed"; }
ctr() { podman ps -a --filter "label=io.podman.compose.project=$PROJECT" --filter "label=io.podman.compose.service=$1" --format '{{.Names}}' | sort; }
setup="$(ctr prefect-setup)"; [ -n "$setup" ] || die "no prefect-setup container"
rc="$(timeout 600 podman wait "$setup")" || die "prefect-setup did not finish"
[ "$rc" = 0 ] || { podman logs "$setup" 2>&1 | tail -n 40 >&2; die "prefect-setup exited $rc"; }
mapfile -t WORKERS < <(ctr worker)
[ "${#WORKERS[@]}" = 3 ] || die "expected 3 worker containers, found: ${WORKERS[*]}"
NAMES=()
for w in "${WORKERS[@]}"; do
  for _ in $(seq 1 300); do
    podman logs "$w" 2>&1 | grep -q "started" && break
    [ "$(podman inspect -f '{{.State.Running}}' "$w")" = true ] || { podman logs "$w" 2>&1 | tail -n 30 >&2; die "worker $w exited"; }
    sleep 1
  done
  podman logs "$w" 2>&1 | grep -q "started" || die "worker $w did not start"
  NAMES+=("check-$(podman exec "$w" hostname)")
done
T[up]=$((SECONDS - t0))
echo "workers: ${NAMES[*]}"

# published ports: on 127.0.0.1 only
for port in "$CSE_PG_PORT" "$CSE_PREFECT_PORT" "$CSE_MLFLOW_PORT"; do
  addrs="$(ss -Htln "sport = :$port" | awk '{print $4}' | sed 's/:[0-9]*$//' | sort -u | tr '\n' ' ')"
  [ "$addrs" = "127.0.0.1 " ] || die "port $port listens on: ${addrs:-nothing}"
done
curl -fsS "http://127.0.0.1:$CSE_PREFECT_PORT/api/health" >/dev/null || die "Prefect not published"
curl -fsS "http://127.0.0.1:$CSE_MLFLOW_PORT/health" >/dev/null || die "MLflow not published"

# --- 4. the smoke sweep: two children, fanned out over two of the worker containers ------------------------------
log "smoke sweep"
W1="${WORKERS[0]}"
# the corruption stage reads the whole Wiki1M sample: its first 512 lines, in the workers' shared volume
podman exec "$W1" sh -c 'head -n 512 /shared/data/wiki1m_head.txt > /var/lib/cse/wiki1m_head_512.txt'
params='{"strategy": "grid", "grid": {"learning_rate": [0.01, 0.02]}, "dispatch": "deployment",
  "overrides": {"max_steps": 2, "eval_steps": 2, "log_steps": 1, "max_train_sentences": 64, "test_evaluation": false,
    "ingest": {"datasets": ["wiki1m", "sts"], "wiki": {"path": "/var/lib/cse/wiki1m_head_512.txt"},
               "senteval": {"path": "/shared/data/senteval"}}}}'
t0=$SECONDS
podman exec "$W1" prefect deployment run sweep/smoke --params "$params" --watch --watch-timeout "$SWEEP_TIMEOUT" \
  >"$WORK/sweep.log" 2>&1 || true
T[sweep]=$((SECONDS - t0))
grep -q "Completed" "$WORK/sweep.log" || {
  tail -n 40 "$WORK/sweep.log" >&2
  for w in "${WORKERS[@]}"; do echo "--- $w" >&2; podman logs "$w" 2>&1 | tail -n 40 >&2; done
  die "the sweep did not complete (log: $WORK/sweep.log)"; }

# --- 5. checks, from inside a worker (the stack's own addresses) ---------------------------------------------
log "checks"
podman exec -i -e "CHECK_WORKERS=${NAMES[*]}" -e "CHECK_PG_PASSWORD=$CSE_PG_PASSWORD" "$W1" python - <<'EOF'
import os

import httpx
import mlflow
import psycopg

api, grid, workers = os.environ["PREFECT_API_URL"], [0.01, 0.02], set(os.environ["CHECK_WORKERS"].split())
children = httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"tags": {"all_": ["child"]}}, "limit": 50},
                      timeout=30).json()
assert len(children) == len(grid), [c["name"] for c in children]
assert {c["state_type"] for c in children} == {"COMPLETED"}, [(c["name"], c["state_type"]) for c in children]

client = mlflow.MlflowClient()
exp = client.get_experiment_by_name("d2cse")
parents = client.search_runs([exp.experiment_id], "tags.`cse.parent` = 'true' and tags.`cse.kind` = 'sweep'")
assert len(parents) == 1, len(parents)
parent = parents[0]
kids = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
assert sorted(k.data.tags["cse.child"] for k in kids) == sorted(f"learning_rate={lr}" for lr in grid)
assert all(k.info.status == "FINISHED" and "best_stsb_dev" in k.data.metrics for k in kids)
ran = {k.data.tags.get("worker") for k in kids}
# one slot per worker and the parent holding one: the two children ran side by side on two other workers
assert len(ran) == 2 and ran <= workers, f"children ran on {ran}, workers {workers}"
assert {"sweep.md", "sweep.json"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}

pw = os.environ["CHECK_PG_PASSWORD"]
for db, sql, least in (("mlflow", "SELECT count(*) FROM runs", 3),
                       ("prefect", "SELECT count(*) FROM flow_run WHERE state_type = 'COMPLETED'", 3)):
    with psycopg.connect(host="postgres", user="cse", password=pw, dbname=db, connect_timeout=10) as con:
        n = con.execute(sql).fetchone()[0]
    assert n >= least, (db, n)
print(f"OK: sweep parent {parent.info.run_id} with {len(kids)} children on {sorted(ran)}; "
      f"best_stsb_dev {parent.data.metrics['best_stsb_dev']:.4f}")
EOF

log "timings"
echo "base image (debootstrap + import): ${T[base]}  $(size "$BASE_IMAGE")"
echo "CPU image build: ${T[build_cpu]}s  $(size "$IMAGE")"
echo "PostgreSQL image build: ${T[build_pg]}s  $(size "$PG_IMAGE")"
echo "stack up (compose up until the three workers started): ${T[up]}s"
echo "smoke sweep (2 children on 2 of the 3 worker containers): ${T[sweep]}s"
echo "container_stack_check: OK"
