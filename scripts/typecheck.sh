#!/usr/bin/env bash
# mypy cannot follow setuptools' package-dir mapping (cache/ -> pffs.cache, csi/ -> pffs.csi), so it
# checks a tree of symlinks laid out the way the package installs.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/pffs"
for entry in pffs/*; do ln -s "$PWD/$entry" "$tree/pffs/"; done
ln -s "$PWD/cache" "$tree/pffs/cache"
ln -s "$PWD/csi" "$tree/pffs/csi"
cd "$tree" && ../../.venv/bin/mypy --config-file ../../pyproject.toml -p pffs
