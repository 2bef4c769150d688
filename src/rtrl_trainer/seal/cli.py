"""``rtrl-job seal``: its flags, and the run through the shared runner."""

from __future__ import annotations

import argparse
import contextlib

import pyarrow as pa

from rtrl.core.events import SIGNALS
from rtrl.core.store import parse_store_uri
from rtrl_trainer import progress
from rtrl_trainer.runner import (
    EXIT_OK,
    add_config_argument,
    add_endpoint_argument,
    add_now_argument,
    add_work_dir_argument,
    run_step,
    step_now,
    work_dir,
)
from rtrl_trainer.seal.config import (
    DEFAULT_DELAY,
    DEFAULT_LOOKBACK,
    DEFAULT_MEMORY_LIMIT,
    SealConfig,
    duration,
    maturities,
)
from rtrl_trainer.seal.step import SealError, seal
from rtrl_trainer.spec_file import ConfigError, load_sections

DESCRIPTION = """Join each hour's generation events with its feedback events once every
signal's maturity has passed, and write them as interaction shards under --shards, with a
marker per sealed hour (_sealed/date=/hour=.json) written last. Rerunnable: sealed hours
are skipped (their late feedback counted), a crashed hour is sealed again from scratch.
Exit 0 when it ran, 1 when a store or an event file failed (rerun), 2 for usage errors."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument(
        "--events", metavar="URI", required=True,
        help="the events root (spec.capture.events): generations/ under it",
    )  # fmt: skip
    parser.add_argument(
        "--feedback-events", metavar="URI",
        help="the root holding feedback/ (default: --events)",
    )  # fmt: skip
    parser.add_argument(
        "--shards", metavar="URI",
        help="the shard root (default: data.shards of --config)",
    )  # fmt: skip
    add_config_argument(parser, "data (its shards)")
    add_now_argument(parser, "the present: which hours are sealable")
    parser.add_argument(
        "--delay", metavar="DURATION", default=DEFAULT_DELAY,
        help=f"wait this long past every maturity for the last events to ship "
        f"(default {DEFAULT_DELAY})",
    )  # fmt: skip
    parser.add_argument(
        "--maturity", metavar="SIGNAL=DURATION", action="append", default=[],
        help="when a signal is final, after the interaction was served (repeatable; "
        "defaults: " + ", ".join(f"{n}={_short(s.maturity.total_seconds())}"
                                for n, s in SIGNALS.items()) + ")",
    )  # fmt: skip
    parser.add_argument(
        "--lookback", metavar="DURATION", default=DEFAULT_LOOKBACK,
        help=f"consider the hours this far back from --now (default {DEFAULT_LOOKBACK}); "
        "an hour older than that is never sealed: pass a longer one to catch up",
    )  # fmt: skip
    parser.add_argument(
        "--memory-limit", metavar="SIZE", default=DEFAULT_MEMORY_LIMIT,
        help=f"the join's memory (DuckDB's memory_limit, e.g. 512MB, 2GB); beyond it, it "
        f"spills to --work-dir (default {DEFAULT_MEMORY_LIMIT})",
    )  # fmt: skip
    add_endpoint_argument(parser)
    add_work_dir_argument(parser, "the hour's event files (on S3) and the join's spill")


def _short(seconds: float) -> str:
    return f"{int(seconds // 3600)}h" if seconds % 3600 == 0 else f"{int(seconds // 60)}m"


def _shards(args: argparse.Namespace) -> str:
    """``--shards``, else ``data.shards`` of ``--config``."""
    if args.shards is not None:
        return str(args.shards)
    if args.config is not None:
        found, base = load_sections(args.config, ("data",))
        shards = found["data"].get("shards")
        if isinstance(shards, str) and shards:
            return shards
        where = f"{base}." if base else ""
        raise ConfigError(f"{args.config}: {where}data.shards: required (or pass --shards)")
    raise ConfigError("--shards: required: pass --shards URI, or --config with data.shards")


def build_config(args: argparse.Namespace) -> SealConfig:
    args.shards = _shards(args)
    for flag, uri in (("--events", args.events), ("--feedback-events", args.feedback_events),
                      ("--shards", args.shards)):  # fmt: skip
        if uri is None:
            continue
        try:
            parse_store_uri(uri)
        except ValueError as exc:
            raise ConfigError(f"{flag}: {exc}") from None
    lookback = duration(args.lookback, "--lookback")
    if lookback < duration("1h", "--lookback"):
        raise ConfigError("--lookback: at least 1h")
    return SealConfig(
        events=args.events,
        feedback_events=args.feedback_events or args.events,
        shards=args.shards,
        now=step_now(args),
        delay=duration(args.delay, "--delay"),
        lookback=lookback,
        maturity=maturities(args.maturity),
        memory_limit=args.memory_limit,
        endpoint_url=args.endpoint_url,
        work_dir=work_dir(args),
    )


def run(args: argparse.Namespace) -> int:
    """``rtrl-job seal``: seal what is sealable, print a summary (with --log-format json,
    one object whose fields hold every count)."""
    return run_step("seal", lambda: _run(args), failures=(SealError,))


def use_jemalloc() -> None:
    """Arrow's buffers from jemalloc where the wheel has it: the seal allocates and frees
    a batch of tokens tens of MB large many times over, which mimalloc (the default)
    hands back to the kernel and faults in again each time: 1 CPU-s of 6 spent reading
    and writing the rows of 1M interactions, most of it in the kernel. The scan baseline
    in bench/seal.py is measured with the faster of the two as well."""
    with contextlib.suppress(NotImplementedError):
        pa.set_memory_pool(pa.jemalloc_memory_pool())


def _run(args: argparse.Namespace) -> int:
    use_jemalloc()
    result = seal(build_config(args))
    line = result.summary()
    if progress.log_format() == "json":
        progress.emit("seal", "result", line, **result.doc())
    else:
        print(line, flush=True)
    return EXIT_OK
