"""What the eval step reads besides the checkpoints: the stage's held-out set, and the
parent's cached results.

The parent's own results (its generations, task outcomes and log-likelihoods) depend only
on the parent, the suites and the evaluator settings, so they are cached under
``<parent>/_eval-cache/<key>.json`` (or next to ``--out`` when the parent's prefix is not
writable) and reused by every later cycle evaluating against the same parent.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rtrl.core.store import ObjectStore, StoreError, open_store, split_uri
from rtrl_trainer.checkpoint_io import fetch_committed
from rtrl_trainer.evaluate import suite as tasks
from rtrl_trainer.evaluate.config import CACHE_FORMAT, EvalConfig, EvalError
from rtrl_trainer.stagedset import HELDOUT_DIR, PackedError, to_lists


def load_heldout(store: ObjectStore, dest: Path) -> tuple[pa.Table, dict[str, str]]:
    manifest = store.committed("")
    if manifest is None:
        raise EvalError(f"--heldout {store.uri}: not committed (no manifest); treated as absent")
    names = sorted(
        n for n in manifest.files if n.startswith(f"{HELDOUT_DIR}/") and n.endswith(".parquet")
    )
    if not names:
        raise EvalError(
            f"--heldout {store.uri}: no {HELDOUT_DIR}/*.parquet in its manifest (was the stage "
            "run with --heldout-fraction 0, or without enough data?)"
        )
    fetched, _ = fetch_committed(store, dest, label="--heldout", names=names)
    try:
        # Per-token columns packed by the stage (lists in sets staged before packing).
        tables = [to_lists(pq.read_table(dest / n)) for n in names]
    except (pa.ArrowInvalid, PackedError, OSError) as exc:
        raise EvalError(f"--heldout {store.uri}: unreadable: {exc}") from None
    return pa.concat_tables(tables, promote_options="default"), fetched.files


def cache_key(
    config: EvalConfig,
    parent_files: dict[str, str],
    heldout_files: dict[str, str],
    code_suites: dict[str, tasks.Suite],
) -> str:
    options = config.options.model_dump(exclude={"resamples", "task_workers", "insecure_sandbox"})
    doc = {
        "format": CACHE_FORMAT,
        "parent": parent_files,
        "suites": sorted(str(s) for s in config.spec.suites),
        "heldout": heldout_files,
        "tasks": {n: [s.version, s.sha256, len(s.tasks)] for n, s in sorted(code_suites.items())},
        "options": options,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def cache_stores(config: EvalConfig, parent: ObjectStore) -> list[ObjectStore]:
    """Where the parent's results are cached: its own prefix, else beside ``--out``."""
    stores = [parent]
    try:
        up, _ = split_uri(config.out.rstrip("/"))
        stores.append(open_store(up, endpoint_url=config.endpoint_url))
    except (StoreError, ValueError):
        pass  # --out at the root of its store: the parent's prefix only
    return stores


def read_cache(stores: list[ObjectStore], name: str) -> tuple[dict[str, Any] | None, str | None]:
    for store in stores:
        try:
            doc = json.loads(store.get_bytes(name))
        except (StoreError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("format") == CACHE_FORMAT:
            return doc, store.url(name)
    return None, None


def write_cache(stores: list[ObjectStore], name: str, doc: dict[str, Any]) -> str | None:
    data = json.dumps(doc).encode()
    for store in stores:
        try:
            store.put_bytes(name, data)
        except (StoreError, OSError):
            continue
        return store.url(name)
    return None
