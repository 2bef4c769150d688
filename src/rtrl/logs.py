"""Structured logs: ``rtrl operator --log-format json`` writes one JSON object per line, with
the RLCycle and Checkpoint a record is about as fields, so a log pipeline can filter by them.

Where the names come from, first match wins:

1. ``extra={"namespace": ..., "rlcycle": ..., "checkpoint": ...}`` on the logging call;
2. kopf's per-object loggers (their ``k8s_ref``);
3. the arguments of the call: a kind followed by its name, as in
   ``log.info("created %s %s", "Checkpoint", "composer-42")``;
4. the kopf handler or daemon the record was logged from (its object: the RLCycle a
   reconciler works on, also inside the thread it hands a reconcile to).
"""

from __future__ import annotations

import itertools
import json
import logging
from datetime import UTC, datetime
from typing import Any

FIELDS = ("namespace", "rlcycle", "checkpoint")
KINDS = {"RLCycle": "rlcycle", "Checkpoint": "checkpoint"}


def _from_kopf_cause() -> dict[str, str]:
    try:  # the operator's image only: the steps' images have no kopf
        from rtrl.kopf_fixes import handler_body
    except ImportError:  # pragma: no cover - kopf not installed
        return {}
    body = handler_body()
    if not body:
        return {}
    meta = body.get("metadata") or {}
    field = KINDS.get(str(body.get("kind")))
    out = {"namespace": meta.get("namespace")}
    if field:
        out[field] = meta.get("name")
    return {k: str(v) for k, v in out.items() if v}


def context_fields(record: logging.LogRecord) -> dict[str, str]:
    """The namespace, RLCycle and Checkpoint a record is about (those known)."""
    out: dict[str, str] = {}

    def put(key: str, value: Any) -> None:
        if value and key not in out:
            out[key] = str(value)

    for key in FIELDS:
        put(key, getattr(record, key, None))
    ref = getattr(record, "k8s_ref", None)
    if isinstance(ref, dict):
        put("namespace", ref.get("namespace"))
        field = KINDS.get(str(ref.get("kind")))
        if field:
            put(field, ref.get("name"))
    args = record.args if isinstance(record.args, tuple) else ()
    for kind, name in itertools.pairwise(args):
        if isinstance(kind, str) and kind in KINDS and isinstance(name, str):
            put(KINDS[kind], name.rsplit("/", 1)[-1])
    for key, value in _from_kopf_cause().items():
        put(key, value)
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, RFC 3339), level, logger, message, the
    namespace/rlcycle/checkpoint it is about, and the exception's traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(context_fields(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries whose DEBUG records carry secrets: botocore prints each request's headers (the
# Authorization signature, X-Amz-Security-Token), urllib3 and the kubernetes client bodies
# and URLs. ``--verbose`` is rtrl's DEBUG, never theirs.
QUIET_BELOW_INFO = ("botocore", "boto3", "s3transfer", "urllib3", "kubernetes")


def configure(log_format: str, *, verbose: bool = False) -> None:
    """Set up the root logger for ``rtrl operator``: ``text`` (default) or ``json``."""
    handler = logging.StreamHandler()
    formatter: logging.Formatter = (
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for name in QUIET_BELOW_INFO:
        logging.getLogger(name).setLevel(logging.INFO)


__all__ = ["JsonFormatter", "configure", "context_fields"]
