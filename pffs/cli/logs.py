"""Where the command's and the mount process's logs go."""

from __future__ import annotations

import logging
from pathlib import Path

from pffs.log_lines import JsonFormatter


def configure_logging(verbosity: int, log_file: Path | None = None, log_format: str = "text") -> None:
    """-v info, -vv debug (with the S3 libraries' own logs); to stderr, or to log_file with timestamps;
    `log_format` "json" writes one JSON object per line to stderr."""
    level = logging.DEBUG if verbosity > 1 else logging.INFO if verbosity == 1 else logging.WARNING
    if log_file is None and log_format == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=level, handlers=[handler], force=True)
    elif log_file is None:
        logging.basicConfig(level=level, format="pffs: %(levelname)s: %(message)s", force=True)
    else:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        logging.basicConfig(
            level=level,
            filename=log_file,
            format="%(asctime)s pffs[%(process)d] %(levelname)s %(name)s: %(message)s",
            force=True,
        )
    if verbosity < 2:
        for noisy in ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "pyfuse3"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
