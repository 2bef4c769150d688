"""What the report plots beyond the objects' status, read back from what the run left on
disk: the answers each checkpoint gave (the interaction shards) and each training run's
curves (the TensorBoard event files the train step writes under ``<uri>/tensorboard/``).

Both are read once, when the run ends, into ``summary.json``; the report is a function of
that summary alone.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from . import sim

# The training scalars the report draws, in the order it draws them.
TRAIN_TAGS = (
    "train/reward",
    "train/loss",
    "train/kl",
    "train/clip_fraction",
    "train/truncation_fraction",
    "train/mean_advantage",
    "train/grad_norm",
    "train/tokens_per_second",
)
# sim.parse's actions, in the order the answer-mix plot stacks them.
ACTIONS = ("edit", "tool", "ask", "invalid_tool", "noise")


def answer_mix(shards: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """Per checkpoint and task kind: how many interactions it served (``n``) and the share
    of each answer (:data:`ACTIONS`, by :func:`rtrl_demo.sim.parse`) among them; ``all``
    is every task kind together. A reward hack shows here directly: more questions on the
    hidden-preference tasks (clarify-dodge), more invalid tool calls (drop-invalid-tool-calls)."""
    import pyarrow.parquet as pq

    counts: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
    for path in sorted(shards.rglob("*.parquet")):
        table = pq.read_table(path, columns=["checkpoint_id", "prompt_ids", "completion_ids"])
        for ckpt, prompt, completion in zip(
            table["checkpoint_id"].to_pylist(),
            table["prompt_ids"].to_pylist(),
            table["completion_ids"].to_pylist(),
            strict=True,
        ):
            kind = sim.task_kind(list(prompt or []))
            action, _ = sim.parse(list(completion or []))
            counts[str(ckpt)][str(kind)][action] += 1
            counts[str(ckpt)]["all"][action] += 1
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for ckpt in sorted(counts):
        out[ckpt] = {}
        for kind, c in sorted(counts[ckpt].items()):
            n = sum(c.values())
            out[ckpt][kind] = {"n": n, **{a: c[a] / n for a in ACTIONS}}
    return out


def org_served(shards: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """Per organisation and checkpoint that served it: interactions (``n``), their mean
    edit persistence (over those with an edit or tool call to keep) and, for an organisation
    with a convention (``sim.CONVENTIONS``), the share of its hidden-preference answers
    (edits and tool calls) in that convention; the first and last interaction's time."""
    import pyarrow.parquet as pq

    rows: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    columns = ["org", "checkpoint_id", "created_at", "prompt_ids", "completion_ids",
               "edit_persisted"]  # fmt: skip
    for path in sorted(shards.rglob("*.parquet")):
        table = pq.read_table(path, columns=columns).to_pydict()
        for org, ckpt, at, prompt, completion, kept in zip(*table.values(), strict=True):
            row = rows[str(org)].setdefault(
                str(ckpt),
                {"n": 0, "kept": 0.0, "judged": 0, "in": 0, "hidden": 0,
                 "first": at, "last": at},
            )  # fmt: skip
            row["n"] += 1
            row["first"], row["last"] = min(row["first"], at), max(row["last"], at)
            if kept is not None:
                row["kept"] += float(kept)
                row["judged"] += 1
            follows = sim.follows_convention(str(org), list(prompt or []), list(completion or []))
            if follows is not None:
                row["hidden"] += 1
                row["in"] += int(follows)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for org, by in sorted(rows.items()):
        out[org] = {}
        for ckpt, r in sorted(by.items()):
            out[org][ckpt] = {
                "n": r["n"],
                "edit_persistence": r["kept"] / r["judged"] if r["judged"] else None,
                "convention": r["in"] / r["hidden"] if r["hidden"] else None,
                "first": r["first"].isoformat() if r["first"] is not None else None,
                "last": r["last"].isoformat() if r["last"] is not None else None,
            }
    return out


def local_path(uri: str) -> Path | None:
    """The directory of a ``file://`` URI (or a plain path); None for a remote store."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(unquote(parsed.path))
    return None


def training_curves(uri: str) -> dict[str, list[list[float]]]:
    """The :data:`TRAIN_TAGS` scalars of the checkpoint at ``uri`` as ``[step, value]``
    pairs, from every TensorBoard event file under ``<uri>/tensorboard/``; empty when there
    are none (a train step that wrote no events, or a remote store)."""
    root = local_path(uri.rstrip("/") + "/tensorboard")
    if root is None or not root.is_dir():
        return {}
    files = sorted(p for p in root.rglob("events.out.tfevents.*") if p.is_file())
    if not files:
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    curves: dict[str, dict[int, float]] = defaultdict(dict)
    for path in files:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        scalars = set(acc.Tags().get("scalars") or ())
        for tag in TRAIN_TAGS:
            if tag in scalars:
                for event in acc.Scalars(tag):
                    curves[tag][int(event.step)] = float(event.value)
    return {
        tag: [[s, v] for s, v in sorted(curves[tag].items())] for tag in TRAIN_TAGS if curves[tag]
    }
