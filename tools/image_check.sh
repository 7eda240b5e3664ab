#!/usr/bin/env bash
# Build the container images and smoke-test them (not part of `make test`; `make image-check`).
#
#   tools/image_check.sh [cpu|full|all]        default: all
#
# Needs podman (or ENGINE=docker) and, to make a local base image, root with debootstrap:
# - PYTHON_IMAGE given (e.g. python:3.11-slim on a machine with Docker Hub): built on it.
# - PYTHON_IMAGE not given: a Debian bookworm base with python3 and venv is made with debootstrap
#   from the machine's Debian mirror, the machine's CA bundle copied in so pip inside a build
#   reaches the package index as the machine does, and imported as localhost/py-base:3.11 (kept
#   for the next run).
# - TORCH_FIND_LINKS: a directory of wheels mounted into the build, where torch==2.13.0's CPU
#   build lies (default /opt/wheels when it holds one); else the index's torch (see the Dockerfiles).
# Each image's entrypoint is then run and checked by tools/image_smoke.py (podman run where it
# works, else chrooted into the mounted image: it says which), which prints the figures for
# docs/DEPLOY.md: layer sizes, cold start with an empty and a warm cache volume, idle RSS.
set -euo pipefail

cd "$(dirname "$0")/.."
WHAT="${1:-all}"
ENGINE="${ENGINE:-podman}"
PYTHON="${PYTHON:-.venv/bin/python}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

base_image() {
  if [[ -n "${PYTHON_IMAGE:-}" ]]; then
    echo "$PYTHON_IMAGE"
    return
  fi
  if ! "$ENGINE" image exists localhost/py-base:3.11 2>/dev/null; then
    local rootfs
    rootfs="$(mktemp -d)/rootfs"
    echo "making localhost/py-base:3.11 with debootstrap ($MIRROR)" >&2
    debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" >&2
    cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
    chroot "$rootfs" bash -c "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
      --no-install-recommends python3 python3-venv python-is-python3 ca-certificates && apt-get clean" >&2
    rm -rf "$rootfs"/var/lib/apt/lists/*
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
    tar -C "$rootfs" -c . | "$ENGINE" import - localhost/py-base:3.11 >&2
    rm -rf "$(dirname "$rootfs")"
  fi
  echo localhost/py-base:3.11
}

build() {
  local kind="$1" base="$2" args=()
  local links="${TORCH_FIND_LINKS:-}"
  if [[ -z "$links" ]] && compgen -G "/opt/wheels/torch-2.13.0+cpu-*.whl" > /dev/null; then
    links=/opt/wheels
  fi
  if [[ -n "$links" ]]; then
    args+=(--build-arg "TORCH_FIND_LINKS=$links" -v "$links:$links:ro")
  fi
  if [[ "$ENGINE" == podman ]]; then
    args+=(--format docker --isolation chroot)  # docker format keeps HEALTHCHECK
  fi
  echo "building localhost/outrider:$kind on $base" >&2
  local start=$SECONDS
  "$ENGINE" build --network host "${args[@]}" --build-arg "PYTHON_IMAGE=$base" \
    -f "docker/Dockerfile.$kind" -t "localhost/outrider:$kind" .
  echo "built localhost/outrider:$kind in $((SECONDS - start)) s" >&2
}

base="$(base_image)"
for kind in cpu full; do
  if [[ "$WHAT" == all || "$WHAT" == "$kind" ]]; then
    build "$kind" "$base"
    extra=()
    if [[ "$kind" == full ]]; then  # a user's GGUF from a volume: the packaged SmolLM2 file will do
      extra=(--gguf "$("$PYTHON" -c 'from outrider_llm.artifact import smollm2_gguf_path; print(smollm2_gguf_path())')")
    fi
    "$PYTHON" tools/image_smoke.py --image "localhost/outrider:$kind" --kind "$kind" "${extra[@]}"
  fi
done
