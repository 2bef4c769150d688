"""``rtrl-feedback``: the feedback service's flags (each with an environment fallback, which
the chart sets) and its start-up.

Exit status 2 for a usage error (a bad flag, an unreadable token file, an events URI no
store understands), before anything listens.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

from aiohttp import web

from rtrl import __version__
from rtrl.core.store import StoreError, open_store
from rtrl_serving.feedback.app import build_app
from rtrl_serving.feedback.commit import GroupCommitter, writer_id
from rtrl_serving.feedback.events import Limits
from rtrl_serving.feedback.tokens import Tokens

EXIT_USAGE = 2


def _number(kind: Callable[[str], float], low: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: must be >= {low:g}")
        return value

    return parse


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: expected host:port, e.g. 0.0.0.0:8082")
    return host.strip("[]") or "0.0.0.0", int(port)


# flag -> (env, type, default, help)
FLAGS: dict[str, tuple[str, Callable[[str], object], object, str]] = {
    "--listen": ("RTRL_FEEDBACK_LISTEN", _listen, "0.0.0.0:8082", "host:port to serve on"),
    "--events": ("RTRL_FEEDBACK_EVENTS", str, None,
                 "events root URI (s3:// or file://); feedback events go under feedback/"),
    "--token-file": ("RTRL_FEEDBACK_TOKEN_FILE", Path, None,
                     "file of accepted bearer tokens, one a line (a mounted Secret)"),
    "--max-body-bytes": ("RTRL_FEEDBACK_MAX_BODY_BYTES", _number(int, 1024), 1 << 20,
                         "largest request body (413 above)"),
    "--max-events": ("RTRL_FEEDBACK_MAX_EVENTS", _number(int, 1), 1000,
                     "most events in one request (400 above)"),
    "--max-skew": ("RTRL_FEEDBACK_MAX_SKEW_S", _number(float, 0), 300.0,
                   "seconds a client's clock may be ahead: observed_at later than now plus "
                   "this is refused"),
    "--max-inflight": ("RTRL_FEEDBACK_MAX_INFLIGHT", _number(int, 1), 4,
                       "group writes to the store at once"),
    "--linger-ms": ("RTRL_FEEDBACK_LINGER_MS", _number(float, 0), 0.0,
                    "wait this long after a group's first event for more (0: the write in "
                    "flight gathers the next group)"),
    "--endpoint-url": ("AWS_ENDPOINT_URL", str, None, "S3-compatible endpoint"),
    "--log-level": ("RTRL_FEEDBACK_LOG_LEVEL", str, "info", "debug, info, warning, error"),
}  # fmt: skip


def build_parser(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="rtrl-feedback",
        description="Accept users' feedback on served interactions (POST /v1/feedback) and "
        "make it durable in the events store before answering 202.",
    )
    parser.add_argument("--version", action="version", version=f"rtrl-feedback {__version__}")
    for flag, (name, kind, default, text) in FLAGS.items():
        raw = env.get(name)
        value: object = default
        if raw:
            try:
                value = kind(raw)
            except argparse.ArgumentTypeError as exc:
                parser.error(f"${name}: {exc}")
        elif isinstance(default, str) and kind is not str:
            value = kind(default)
        parser.add_argument(flag, type=kind, default=value, help=f"{text} (${name})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format='{"time": "%(asctime)s", "level": "%(levelname)s", "message": "%(message)s"}',
    )
    for flag, value in (("--events", args.events), ("--token-file", args.token_file)):
        if not value:
            env = FLAGS[flag][0]
            print(f"rtrl-feedback: {flag} (or ${env}) is required", file=sys.stderr)
            return EXIT_USAGE
    tokens = Tokens(args.token_file)
    if not tokens.loaded:
        print(f"rtrl-feedback: {tokens.error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        store = open_store(args.events, endpoint_url=args.endpoint_url)
    except (ValueError, StoreError) as exc:
        print(f"rtrl-feedback: --events: {exc}", file=sys.stderr)
        return EXIT_USAGE
    writer = writer_id()
    committer = GroupCommitter(
        store,
        writer,
        max_inflight=int(args.max_inflight),
        linger_s=float(args.linger_ms) / 1000,
    )
    limits = Limits(max_events=int(args.max_events), max_skew=timedelta(seconds=args.max_skew))
    app = build_app(committer, tokens, limits=limits, max_body_bytes=int(args.max_body_bytes))
    host, port = args.listen
    logging.getLogger("rtrl.feedback").info(
        "rtrl-feedback %s listening on %s:%d, events to %s", writer, host, port, store.uri
    )
    web.run_app(app, host=host, port=port, access_log=None, print=None, shutdown_timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
