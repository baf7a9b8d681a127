#!/usr/bin/env bash
# Rewrites constraints.txt: the exact versions `make setup` installs. Run after changing dependencies in
# pyproject.toml (pin the s3fs/fsspec pair by hand if pip's resolver starts backtracking over aiobotocore).
set -euo pipefail
cd "$(dirname "$0")/.."
report=$(mktemp)
trap 'rm -f "$report"' EXIT
.venv/bin/python -m pip install -q --dry-run --ignore-installed --report "$report" -e '.[dev]' "$@"
.venv/bin/python - "$report" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
pins = sorted(
    f"{item['metadata']['name']}=={item['metadata']['version']}"
    for item in report["install"]
    if item["metadata"]["name"] != "pffs"
)
header = (
    "# Exact versions for `make setup` (pip install -c constraints.txt): a fast, repeatable install.\n"
    "# Regenerate with scripts/lock.sh after changing dependencies in pyproject.toml.\n"
)
open("constraints.txt", "w").write(header + "\n".join(pins) + "\n")
print(f"constraints.txt: {len(pins)} packages")
PY
