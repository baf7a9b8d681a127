"""With `--log-format json` every line the mounter writes is one JSON object, its mounts' lines included:
a mount logs to its file in text (configure_logging with a log file), and the mounter's relay (LogRelay in
csi/mount_runner.py) turns each line into an object like the mounter's own, with the volume and the
mount's pid; a traceback's lines stay objects too. In text mode the lines keep their `mount[volume=...]`
prefix."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pffs.csi.mount_runner import LogRelay
from pffs.log_lines import JsonFormatter

MOUNT_LOGS = """
import logging, sys
from pathlib import Path
from pffs.cli.logs import configure_logging
configure_logging(1, Path(sys.argv[1]))
logging.getLogger("pffs.fuse.mount").info("mounted s3://b/ds at /mnt (pid %d)", 42)
try:
    1 / 0
except ZeroDivisionError:
    logging.getLogger("pffs.vfs").exception("a read failed")
"""


def relay(log_file: Path, capsys: pytest.CaptureFixture[str], lines: int) -> list[str]:
    """Lines the relay copies from `log_file` to stderr, once it has copied `lines` of them."""
    relay = LogRelay()
    try:
        relay.follow(log_file, "csi-5d41402abc4b2a76").offset = 0
        out: list[str] = []
        deadline = time.monotonic() + 10
        while len(out) < lines and time.monotonic() < deadline:
            time.sleep(0.1)
            out += capsys.readouterr().err.splitlines()
        return out
    finally:
        relay.stop()


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_a_mounts_log_lines_reach_the_mounters_output_in_its_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], log_format: str
) -> None:
    log_file = tmp_path / "mount.log"
    subprocess.run([sys.executable, "-c", MOUNT_LOGS, str(log_file)], check=True, timeout=60)
    written = log_file.read_text().splitlines()
    assert len(written) >= 4  # two records, the second with a traceback
    root = logging.getLogger()
    saved = root.handlers[:]
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    root.handlers = [handler]
    try:
        out = relay(log_file, capsys, len(written))
    finally:
        root.handlers = saved
    assert len(out) == len(written), out
    if log_format == "text":
        assert out == [f"mount[volume=csi-5d41402abc4b2a76] {line}" for line in written]
        return
    entries = [json.loads(line) for line in out]  # every line, the traceback's too
    assert all(e["volume"] == "csi-5d41402abc4b2a76" for e in entries)
    first, second = entries[0], entries[1]
    assert first["level"] == "info" and first["logger"] == "pffs.fuse.mount"
    assert first["message"] == "mounted s3://b/ds at /mnt (pid 42)"
    assert isinstance(first["pid"], int) and "T" in first["time"]
    assert second["level"] == "error" and second["message"] == "a read failed"
    assert entries[-1]["message"] == "ZeroDivisionError: division by zero"
