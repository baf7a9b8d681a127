"""How the command line reports failure: one line on stderr, and an exit code a script can test."""

from __future__ import annotations

import errno
import logging
import sys
from collections.abc import Callable

from pydantic import ValidationError

from pffs.backends.errors import BackendUnavailableError, BadOptionError, UnknownSchemeError
from pffs.config import settings_error

log = logging.getLogger("pffs")

EXIT_OK = 0
EXIT_FAILURE = 1  # the command ran and failed (missing object, access denied, backend down)
EXIT_USAGE = 2  # the command line itself is wrong (as argparse uses)


class UsageError(Exception):
    pass


def run_reporting_errors(command: Callable[[], int]) -> int:
    try:
        return command()
    except (UsageError, BadOptionError, UnknownSchemeError) as exc:
        print(f"pffs: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValidationError as exc:
        print(f"pffs: error: {settings_error(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except BackendUnavailableError as exc:
        print(f"pffs: error: {exc} (is the endpoint right and the server up?)", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:
        return EXIT_OK  # `pffs cat ... | head`: the reader left, nothing went wrong
    except OSError as exc:
        detail = exc.strerror or str(exc)
        if exc.filename and str(exc.filename) not in detail:
            detail = f"{exc.filename}: {detail}"
        if exc.errno == errno.ENOSPC:
            detail += " (the disk is full)"
        print(f"pffs: error: {detail}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("pffs: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: say so once, with the traceback only under -v
        log.debug("unexpected error", exc_info=True)
        print(
            f"pffs: internal error: {type(exc).__name__}: {exc} (run with -v for the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILURE
