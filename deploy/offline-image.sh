#!/usr/bin/env bash
# Kervan's image on a machine that reaches no image registry, only Debian's mirror and PyPI: a
# Debian base made with debootstrap and imported into podman, then deploy/Dockerfile built on it
# with torch's CPU wheel from a local folder (WHEELS) and the CA bundle pip must trust (CA, for a
# proxy's certificate). Run as root from the repository root; compose.offline.yaml then runs it.
# Where the kernel refuses podman's defaults (a container without CAP_SYS_RESOURCE, cgroups v1),
# point CONTAINERS_CONF at a file that sets runtime = "runc" and lower default_ulimits
# (tests/test_compose_podman.py writes one).
set -euo pipefail
ROOTFS=${ROOTFS:-/var/tmp/kervan-rootfs}
WHEELS=${WHEELS:-/opt/wheels}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
CA=${CA:-/etc/ssl/certs/ca-certificates.crt}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

if ! podman image exists localhost/kervan-base:bookworm; then
  debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,g++,redis-server,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR"
  tar -C "$ROOTFS" -c . | podman import - localhost/kervan-base:bookworm
fi
podman build -v "$WHEELS:/opt/wheels:ro" -v "$CA:/opt/host-ca.crt:ro" \
  --build-arg BASE=localhost/kervan-base:bookworm --build-arg PIP_FIND_LINKS=/opt/wheels \
  --build-arg PIP_CERT=/opt/host-ca.crt --build-arg TORCH_SPEC="$TORCH_SPEC" \
  --build-arg TORCH_INDEX=https://pypi.org/simple -f deploy/Dockerfile -t localhost/kervan:latest .
