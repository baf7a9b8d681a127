"""The background mount process that `pffs mount` starts: options as JSON on stdin; one line on stdout,
"ok" once mounted or "error: ..." (then exit non-zero); logs to the log file (stderr)."""

from __future__ import annotations

import os
import sys

from pffs.cli.errors import EXIT_FAILURE, describe_failure
from pffs.cli.logs import configure_logging
from pffs.fuse.options import MountOptions


def main() -> int:
    options = MountOptions.model_validate_json(sys.stdin.buffer.read())
    configure_logging(max(1, options.verbose), options.log_file)
    answered = False

    def ready() -> None:
        nonlocal answered
        os.write(1, b"ok\n")
        answered = True
        # Nothing else is written there; let `pffs mount` see end-of-file and return.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)

    from pffs.fuse.mount import serve

    try:
        return serve(options, ready)
    except Exception as exc:
        message, code = describe_failure(exc)
        import logging

        logging.getLogger("pffs").error("%s", message, exc_info=not isinstance(exc, OSError | ValueError))
        if not answered:
            os.write(1, (message.replace("\n", " ") + "\n").encode())
        return code or EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
