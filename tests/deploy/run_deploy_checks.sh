#!/usr/bin/env bash
# The deployment test, one command (about 10 minutes here the first time; not part of .ci/run):
# builds the CPU image, `docker compose up service`, an openai SDK chat through the published port,
# routes via RoutesClient and RouteStore on the compose Redis, a Redis crash and restart, API keys
# from a secret file, `docker compose down`. Prints the image size, build times and time to ready.
#
#   bash tests/deploy/run_deploy_checks.sh
#
# Needs root (or a docker group member) and the repository's .venv (bash scripts/setup.sh).
# On a host without docker it installs Debian's docker.io, and compose v2 and buildx from Debian's
# packages when missing. Where no registry is reachable (this project's CI machines) it builds a
# Debian bookworm base with debootstrap and a Redis image on it, and hands pip the host's CA bundle
# and local torch wheel; elsewhere it uses the official images the Dockerfile and compose.yaml name.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
DEB=http://deb.debian.org/debian
need_root() { [ "$(id -u)" = 0 ] || { echo "run as root (apt, dockerd)" >&2; exit 1; }; }

# dockerd, not just a docker client (some hosts have only /usr/local/bin/docker).
if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
  need_root; apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
fi
# compose v2 (`docker compose`) and buildx: Debian bookworm has neither (its docker-compose is
# v1); trixie's packages are static Go binaries that run on bookworm.
fetch_deb() {  # package
  need_root
  local f; f=$(curl -fsS "$DEB/dists/trixie/main/binary-amd64/Packages.xz" | xz -dc \
    | awk -v p="$1" '$1=="Package:"{ok=($2==p)} ok&&$1=="Filename:"&&!f{f=$2} END{print f}')
  # (awk reads to the end: exiting at the match would SIGPIPE curl and fail the pipeline.)
  curl -fsSo "/tmp/$1.deb" "$DEB/$f" && dpkg -i "/tmp/$1.deb" >/dev/null
}
docker compose version >/dev/null 2>&1 || fetch_deb docker-compose
docker buildx version >/dev/null 2>&1 || fetch_deb docker-buildx

# On exit: the stand-in images this run built go, and a dockerd this run started stops. Only that
# dockerd, by its pid: another one on the host (a user's, a CI runner's) is none of ours.
dockerd_pid=""
standins=()
cleanup() {
  if [ ${#standins[@]} -gt 0 ]; then docker image rm "${standins[@]}" >/dev/null 2>&1 || true; fi
  if [ -n "$dockerd_pid" ]; then
    kill "$dockerd_pid" 2>/dev/null || true
    wait "$dockerd_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT
if ! docker info >/dev/null 2>&1; then
  need_root; dockerd >/tmp/dockerd.log 2>&1 & dockerd_pid=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start: /tmp/dockerd.log" >&2; exit 1; }
fi

# Official images when they can be pulled; local stand-ins otherwise.
if ! docker image inspect python:3.11-slim-bookworm >/dev/null 2>&1 \
   && ! timeout 60 docker pull -q python:3.11-slim-bookworm >/dev/null 2>&1; then
  if ! docker image inspect local/debian:bookworm >/dev/null 2>&1; then
    need_root
    command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
    root=$(mktemp -d /tmp/rr-rootfs.XXXX)
    debootstrap --variant=minbase bookworm "$root" "$DEB" >/tmp/debootstrap.log
    tar -C "$root" -c . | docker import - local/debian:bookworm >/dev/null
    rm -rf "$root"
    standins+=(local/debian:bookworm)
  fi
  export BASE_IMAGE=local/debian:bookworm
fi
if ! docker image inspect redis:7.4-bookworm >/dev/null 2>&1 \
   && ! timeout 60 docker pull -q redis:7.4-bookworm >/dev/null 2>&1; then
  if ! docker image inspect local/redis:7 >/dev/null 2>&1; then
    printf '%s\n' \
      "FROM ${BASE_IMAGE:-local/debian:bookworm}" \
      "RUN apt-get update && apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data" \
      "USER redis" "WORKDIR /data" 'CMD ["redis-server"]' \
      | DOCKER_BUILDKIT=1 docker build --network host -q -t local/redis:7 - >/dev/null
    standins+=(local/redis:7)
  fi
  export REDIS_IMAGE=local/redis:7
fi
# pip inside the build: the host's CA bundle (a build secret, never a layer) and, without a route
# to PyTorch's CPU index, the torch wheel from pip's local find-links folder.
pipconf() {  # key: pip's effective setting (environment first, then its config files)
  local n=${1^^} v; n=${n//-/_}; v=$(printenv "PIP_$n" || true)
  [ -n "$v" ] || v=$(python3 -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.$1='\(.*\)'$/\1/p" | head -1)
  printf '%s' "$v"
}
cert=$(pipconf cert)
if [ -n "$cert" ] && [ -f "$cert" ]; then export PIP_CERT_FILE=$cert; fi
if ! curl -fsS -o /dev/null --max-time 10 https://download.pytorch.org/whl/cpu/torch/; then
  links=$(pipconf find-links)
  cp -n "${links:-/nonexistent}"/torch-2.13.0+cpu-cp311-*.whl docker/wheels/ 2>/dev/null \
    || { echo "no route to download.pytorch.org and no torch 2.13.0+cpu wheel in pip's find-links" >&2; exit 1; }
  export PIP_EXTRA_INDEX_URL=
fi
"$PY" tests/deploy/deploy_check.py
