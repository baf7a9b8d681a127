"""How the command line reports failure: one line on stderr, and an exit code a script can test."""

from __future__ import annotations

import errno
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


log = logging.getLogger("pffs")

EXIT_OK = 0
EXIT_FAILURE = 1  # the command ran and failed (missing object, access denied, backend down)
EXIT_USAGE = 2  # the command line itself is wrong (as argparse uses)


class UsageError(Exception):
    pass


def run_reporting_errors(command: Callable[[], int]) -> int:
    try:
        return command()
    except BrokenPipeError:
        return EXIT_OK  # `pffs cat ... | head`: the reader left, nothing went wrong
    except KeyboardInterrupt:
        print("pffs: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        message, code = describe_failure(exc)
        print(f"pffs: {message}", file=sys.stderr)
        return code


def describe_failure(exc: Exception) -> tuple[str, int]:
    """One line for the user (after "pffs: ") and the exit code, for any error a command can meet."""
    from pydantic import ValidationError

    from pffs.backends.errors import BackendUnavailableError, BadOptionError, UnknownSchemeError
    from pffs.config import settings_error

    if isinstance(exc, UsageError | BadOptionError | UnknownSchemeError):
        return f"error: {exc}", EXIT_USAGE
    if isinstance(exc, ValidationError):
        return f"error: {settings_error(exc)}", EXIT_USAGE
    if isinstance(exc, BackendUnavailableError):
        return f"error: {exc} (is the endpoint right and the server up?)", EXIT_FAILURE
    if isinstance(exc, OSError):
        detail = exc.strerror or str(exc)
        if exc.filename and str(exc.filename) not in detail:
            detail = f"{exc.filename}: {detail}"
        if exc.errno == errno.ENOSPC:
            detail += " (the disk is full)"
        return f"error: {detail}", EXIT_FAILURE
    # A bug: say so once, with the traceback only under -vv (debug logging).
    log.debug("unexpected error", exc_info=exc)
    return f"internal error: {type(exc).__name__}: {exc} (run with -vv for the traceback)", EXIT_FAILURE
