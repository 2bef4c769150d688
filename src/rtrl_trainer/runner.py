"""The one runner every ``rtrl-job <step>`` goes through: errors become exit codes.

A step's Job pod ends with one exit code and, on failure, one line on stderr; the operator
reads the code (and the pod's termination message) to decide what the round does next.
The mapping is the same for every step, so it lives here once:

- ``ConfigError``: exit 2, ``rtrl-job <step>: <message>``; not retryable.
- the step's own failures (``failures=``) and ``StoreError``: exit 1,
  ``<step>: <prefix><message>``; retryable.
- ``OSError`` (the local scratch disk): exit 1,
  ``<step>: <prefix>local I/O failed: <message>``; retryable.

"Retryable" means a later run with the same flags can succeed (the store comes back, the
disk is freed, more data matures); a usage error (2) fails the same way every time, so
the operator reports it instead of trying again. Anything else is a bug and propagates
with its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from rtrl.core.store import StoreError
from rtrl_trainer.spec_file import ConfigError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

# exit code -> whether running the step again (same flags) can succeed
RETRYABLE: dict[int, bool] = {EXIT_OK: False, EXIT_FAILED: True, EXIT_USAGE: False}


def one_line(exc: BaseException) -> str:
    """The error's message on one line (a store error may quote a multi-line response)."""
    return " ".join(str(exc).split())


def run_step(
    name: str,
    body: Callable[[], str | int],
    *,
    failures: tuple[type[Exception], ...] = (),
    prefix: str = "",
) -> int:
    """Run ``body`` and return the step's exit code.

    ``body`` returns either its one-line summary (printed on stdout; exit 0) or an exit
    code of its own choosing (printed nothing here). ``failures`` are the step's own error
    classes (e.g. ``StageError``): like a ``StoreError`` they exit 1 with one line on
    stderr, ``prefix`` put before the message (e.g. ``"cannot evaluate: "``).
    """
    failed: tuple[type[Exception], ...] = (*failures, StoreError)
    try:
        result = body()
    except ConfigError as exc:
        print(f"rtrl-job {name}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except failed as exc:
        print(f"{name}: {prefix}{one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        # The local scratch disk (full, unwritable): the step failed, not its inputs.
        print(f"{name}: {prefix}local I/O failed: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    if isinstance(result, int):
        return result
    print(result)
    return EXIT_OK


__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "RETRYABLE", "one_line", "run_step"]
