#!/usr/bin/env bash
# Build the gasloc image for the machine at hand; the docker test builds it the same way.
#   docker/build.sh [--tag T] [--base IMAGE] [--torch SPEC] [--standin] [--wheelhouse] [-- DOCKER_BUILD_ARGS...]
#
# With a base image that can be pulled (default python:3.11-slim-bookworm) it builds as is, pip using the package
# index inside the build. Without one (no Docker Hub), or with --standin, it makes a stand-in base from Debian's
# packages (debootstrap: Python 3.11, pip, venv, CA certificates). Wherever the base comes from, --wheelhouse (the
# default with a stand-in base) builds without any package index: torch and every dependency are first collected
# on this machine with its own pip settings (`pip wheel`, which also finds a local CPU build of torch) and served
# to the build over 127.0.0.1, so pip in the build needs no certificate or proxy.
# Behind a proxy: HTTP_PROXY / HTTPS_PROXY / NO_PROXY from the environment are passed on as build args (Docker
# keeps those out of the image's history). Other pip settings: -- --build-arg PIP_INDEX_URL=... (see Dockerfile).
#
# The stand-in base and the wheelhouse are cached in GASLOC_DOCKER_CACHE (default /var/cache/gasloc-docker), so
# later builds reuse them; image layers are reused by Docker's own cache. Without buildx, the classic builder
# is used (DOCKER_BUILDKIT=0): the Dockerfile needs nothing BuildKit-only.
# Environment: PYTHON (a Python 3.11 with pip, for the wheelhouse; default python3.11), GASLOC_WHEELHOUSE_PORT.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TAG=gasloc:latest
BASE=python:3.11-slim-bookworm
TORCH=torch==2.13.0
STANDIN_TAG=gasloc-standin:bookworm-py3.11
mode_base=auto       # auto | pull | standin
wheelhouse=auto      # auto | yes
CACHE=${GASLOC_DOCKER_CACHE:-/var/cache/gasloc-docker}
PYTHON=${PYTHON:-python3.11}
# A fixed port keeps the build args, and so Docker's layer cache, the same from one build to the next.
PORT=${GASLOC_WHEELHOUSE_PORT:-38611}

die() { echo "build.sh: $*" >&2; exit 2; }
log() { echo "build.sh: $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --tag) TAG=${2:?--tag needs a value}; shift 2 ;;
    --base) BASE=${2:?--base needs a value}; mode_base=pull; shift 2 ;;
    --torch) TORCH=${2:?--torch needs a value}; shift 2 ;;
    --standin) mode_base=standin; shift ;;
    --wheelhouse) wheelhouse=yes; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
extra_build_args=("$@")

command -v docker >/dev/null || die "no docker client on PATH"
docker info >/dev/null 2>&1 || die "the docker engine does not answer (is dockerd running, may this user use it?)"
if ! docker buildx version >/dev/null 2>&1; then
  export DOCKER_BUILDKIT=0  # the client has no buildx: the classic builder
fi

# -- the base image
standin_base() {
  if docker image inspect "$STANDIN_TAG" >/dev/null 2>&1; then
    log "stand-in base $STANDIN_TAG (cached in the engine)"
    return
  fi
  mkdir -p "$CACHE"
  if [ ! -s "$CACHE/standin-rootfs.tar" ]; then
    command -v debootstrap >/dev/null || die "no base image can be pulled and debootstrap is not installed (apt-get install debootstrap)"
    [ "$(id -u)" = 0 ] || die "debootstrap needs root to make the stand-in base"
    log "making the stand-in base with debootstrap (a few minutes, once)"
    local rootfs="$CACHE/rootfs.tmp"
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include=python3.11,python3-venv,python3-pip,ca-certificates \
      bookworm "$rootfs" >"$CACHE/debootstrap.log" 2>&1 || die "debootstrap failed, see $CACHE/debootstrap.log"
    # What python:3.11-slim offers and the Dockerfile relies on: `python` and `pip` commands, pip allowed to
    # install as root (Debian marks its Python externally managed), no apt lists or caches.
    ln -sf python3.11 "$rootfs/usr/bin/python"
    ln -sf pip3 "$rootfs/usr/bin/pip"
    rm -f "$rootfs"/usr/lib/python3.11/EXTERNALLY-MANAGED
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin
    # The build's pip trusts what this machine trusts (Debian's pip reads the system bundle), for builds that use
    # a package index through a proxy that re-signs TLS.
    [ -s /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/"
    tar -C "$rootfs" -cf "$CACHE/standin-rootfs.tar.tmp" . && mv "$CACHE/standin-rootfs.tar.tmp" "$CACHE/standin-rootfs.tar"
    rm -rf "$rootfs"
  fi
  log "importing the stand-in base $STANDIN_TAG from $CACHE/standin-rootfs.tar"
  docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' "$CACHE/standin-rootfs.tar" "$STANDIN_TAG" >/dev/null
}

case "$mode_base" in
  standin) standin_base; BASE=$STANDIN_TAG ;;
  pull)
    docker image inspect "$BASE" >/dev/null 2>&1 || docker pull "$BASE" >/dev/null \
      || die "the base image '$BASE' cannot be pulled (leave out --base to use a stand-in)" ;;
  auto)
    if docker image inspect "$BASE" >/dev/null 2>&1 || timeout 60 docker pull "$BASE" >/dev/null 2>&1; then
      log "base $BASE"
    else
      log "$BASE cannot be pulled here: using a stand-in base"
      standin_base; BASE=$STANDIN_TAG
      [ "$wheelhouse" = auto ] && wheelhouse=yes
    fi ;;
esac

build_args=(--build-arg "BASE=$BASE" --build-arg "TORCH=$TORCH")
for v in HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy; do
  [ -n "${!v:-}" ] && build_args+=(--build-arg "$v")
done

# -- the wheelhouse, served on 127.0.0.1 for the duration of the build
server_pid=
cleanup() { [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
if [ "$wheelhouse" = yes ]; then
  "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null \
    || die "the wheelhouse needs a Python 3.11 with pip (the image's Python): set PYTHON (now '$PYTHON')"
  wheels="$CACHE/wheels"
  mkdir -p "$wheels"
  # The requirements the image installs, plus the build backend that `pip install ./src` needs offline.
  reqs=$(PYTHON="$PYTHON" bash "$ROOT/docker/install.sh" reqs "$ROOT/pyproject.toml" hf)
  key=$(printf '%s\n' "$TORCH" "$reqs" | sha256sum | cut -c1-16)
  if [ ! -e "$wheels/.complete-$key" ]; then
    log "collecting wheels for $TORCH and the dependencies into $wheels"
    mapfile -t req_list <<<"$reqs"
    # shellcheck disable=SC2086  # PIP_WHEEL_ARGS is a word list on purpose
    "$PYTHON" -m pip wheel --quiet --wheel-dir "$wheels" ${PIP_WHEEL_ARGS:-} "$TORCH" "${req_list[@]}" \
      "setuptools>=69" wheel || die "collecting the wheels failed (the pip settings of this machine are used)"
    touch "$wheels/.complete-$key"
  fi
  if ! "$PYTHON" -c 'import socket, sys; socket.create_server(("127.0.0.1", int(sys.argv[1]))).close()' "$PORT" \
      2>/dev/null; then
    PORT=$("$PYTHON" -c 'import socket; s = socket.create_server(("127.0.0.1", 0)); print(s.getsockname()[1])')
    log "the wheelhouse port is taken; using $PORT (Docker's layer cache will miss this once)"
  fi
  "$PYTHON" -m http.server --bind 127.0.0.1 --directory "$wheels" "$PORT" >"$CACHE/wheelhouse.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 50); do
    "$PYTHON" -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1).close()' \
      "$PORT" 2>/dev/null && break
    kill -0 "$server_pid" 2>/dev/null || die "the wheelhouse server did not start, see $CACHE/wheelhouse.log"
    sleep 0.1
  done
  build_args+=(--network host --build-arg PIP_NO_INDEX=1 --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$PORT/"
               --build-arg PIP_TRUSTED_HOST=127.0.0.1)
fi

log "docker build -t $TAG (base $BASE, $TORCH, wheelhouse: $wheelhouse)"
docker build -t "$TAG" "${build_args[@]}" "${extra_build_args[@]}" "$ROOT"
