"""The one runner every ``rtrl-job <step>`` goes through: errors become exit codes (and
the flags every step spells alike: ``--config``, ``--now``, ``--endpoint-url``,
``--work-dir``).

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

import argparse
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from rtrl.core.cliargs import endpoint_url
from rtrl.core.store import StoreError, redact
from rtrl_trainer import progress
from rtrl_trainer.spec_file import ConfigError, time_arg

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def one_line(exc: BaseException) -> str:
    """The error's message on one line (a store error may quote a multi-line response),
    with no URL's secret in it (:func:`~rtrl.core.store.redact`: whatever raised it)."""
    return redact(" ".join(str(exc).split()))


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
        print(f"rtrl-job {name}: {one_line(exc)}", file=sys.stderr)
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
    progress.result(name, result)
    return EXIT_OK


# --- flags every step spells the same way ------------------------------------------------


def add_config_argument(parser: argparse.ArgumentParser, sections: str) -> None:
    """``--config FILE``: the part of the RLCycle the step reads (``sections``, e.g.
    ``"data and/or reward"``)."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        type=Path,
        help=f"YAML/JSON: an RLCycle, its spec, or a mapping with {sections}",
    )


def add_now_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--now ISO8601``: the step's notion of the present (``what``, e.g. "the cycle's
    time"), so that a rerun of the same round decides the same way."""
    parser.add_argument(
        "--now", type=time_arg, metavar="ISO8601", help=f"{what} (default: the clock)"
    )


def add_endpoint_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint-url",
        type=endpoint_url,
        metavar="URL",
        help="S3-compatible endpoint (default: $AWS_ENDPOINT_URL, else AWS)",
    )


def add_work_dir_argument(parser: argparse.ArgumentParser, needs: str) -> None:
    """``--work-dir DIR``: local scratch space (``needs``: how much, in words)."""
    parser.add_argument(
        "--work-dir",
        type=Path,
        metavar="DIR",
        help=f"local scratch directory (default: $TMPDIR); needs {needs}",
    )


def step_now(args: argparse.Namespace) -> datetime:
    """``--now``, else the clock (to the second, as the operator passes it)."""
    now: datetime | None = args.now
    return now if now is not None else datetime.now(UTC).replace(microsecond=0)


def work_dir(args: argparse.Namespace) -> Path | None:
    """``--work-dir``, checked: a usage error (exit 2) when it is not a directory."""
    path: Path | None = args.work_dir
    if path is not None and not path.is_dir():
        raise ConfigError(f"--work-dir {path}: not a directory")
    return path


__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "add_config_argument",
    "add_endpoint_argument",
    "add_now_argument",
    "add_work_dir_argument",
    "one_line",
    "run_step",
    "step_now",
    "work_dir",
]
