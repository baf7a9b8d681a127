#!/usr/bin/env bash
# Installs everything pffs needs on a fresh Debian machine (run as root), and is safe to run again:
# system packages with apt-get (only those missing), then a project virtualenv in .venv with pffs
# installed editable plus its dev tools, at the exact versions of constraints.txt (pip's resolver alone
# can backtrack for many minutes over aiobotocore). Re-runs skip the pip step unless either file changed.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv fio s3fs)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "setup: installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi

stamp=.venv/.pffs-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing Python packages into .venv (pip cache is reused between runs)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
    echo "$want" > "$stamp"
fi
