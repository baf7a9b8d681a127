#!/usr/bin/env bash
# Builds the CSI image without Docker: OCI archives of pffs/csi:0.1.0 (+ the tag 0.1.0-next) and of
# csi-provisioner, for `ctr -n k8s.io images import`. The Debian base (mmdebstrap + deploy/image/install.sh,
# minutes) is cached in ~/.cache/pffs-tools/images/ by a hash of the recipe; the pffs layer is rebuilt from
# this checkout each time. See pffs/testing/csi_image.py.
#   scripts/build_image.sh [build [--out-dir DIR]]   the archives; prints their paths
#   scripts/build_image.sh base                      only the cached base (scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
exec "$PYTHON" -m pffs.testing.csi_image "${@:-build}"
