"""The shapes of pffs's log lines, shared by the commands (pffs/cli/logs.py sets logging up) and the CSI
mounter, which relays its mounts' log files to its own stderr in the same shape as its own lines."""

from __future__ import annotations

import json
import logging
import re

# A line of a mount's log file (configure_logging with log_file): "2026-11-28 07:00:00,123 pffs[42] INFO
# pffs.fuse.mount: message".
FILE_LINE = re.compile(r"^(\d{4}-\d\d-\d\d) (\d\d:\d\d:\d\d)(?:,\d+)? pffs\[(\d+)\] ([A-Z]+) (\S+): (.*)$")


class JsonFormatter(logging.Formatter):
    """One JSON object per line (time, level, logger, message), for log collectors."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def logs_json() -> bool:
    """Whether this process logs JSON (configure_logging with log_format "json")."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


def relayed_line(line: str, volume: str, as_json: bool) -> str:
    """A mount's log line as the process that relays it to its own stderr writes it (`kubectl logs` of the
    mounter): prefixed with the volume, or, when that process logs JSON, one JSON object like its own
    lines with `volume` and the mount's `pid` added. A line that is not a record's first (a traceback's)
    becomes an object of its own, so a log collector never gets a line that is not JSON."""
    if not as_json:
        return f"mount[volume={volume}] {line}"
    found = FILE_LINE.match(line)
    if found is None:
        return json.dumps({"level": "info", "logger": "pffs.mount", "message": line, "volume": volume})
    day, clock, pid, level, logger, message = found.groups()
    entry = {
        "time": f"{day}T{clock}",
        "level": level.lower(),
        "logger": logger,
        "message": message,
        "volume": volume,
        "pid": int(pid),
    }
    return json.dumps(entry)
