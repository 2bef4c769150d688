"""``rtrl-capture``: run the capture sidecar until SIGTERM, then drain.

On SIGTERM (pod deletion, a rollout) aiohttp stops listening, lets the requests in flight
finish (up to ``--drain-timeout-s``), and the spool then fsyncs, closes its segment and
ships everything before the process exits: nothing served is lost while the store answers
within the pod's termination grace period (give the pod at least the drain timeout plus
a few seconds).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from aiohttp import web

from rtrl.core.store import StoreError, open_store, redact
from rtrl_serving.capture.config import ConfigError, parse_args
from rtrl_serving.capture.proxy import CaptureProxy


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        config = parse_args(argv)
    except ConfigError as exc:
        print(f"rtrl-capture: {exc}", file=sys.stderr)
        return 2
    try:
        store = open_store(config.events)
    except (ValueError, StoreError) as exc:
        # The events store cannot be built from what the pod was given (an endpoint with
        # credentials in $AWS_ENDPOINT_URL): one line, as for a flag.
        print(f"rtrl-capture: --events: {redact(' '.join(str(exc).split()))}", file=sys.stderr)
        return 2
    proxy = CaptureProxy(config, store)
    web.run_app(
        proxy.app(),
        host=config.listen_host,
        port=config.listen_port,
        shutdown_timeout=config.drain_timeout_s,
        print=None,
        access_log=None,
    )
    return 0 if proxy.shipped_all in (True, None) else 1


if __name__ == "__main__":
    sys.exit(main())
