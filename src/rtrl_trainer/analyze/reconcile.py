"""Lost rows, seen at every unit: each arm's logged interactions against its share, and
against what it served.

A logging fault in one arm (a writer dropping rows, rows of failed edits never written)
biases that arm's metrics without moving its share of *units*: with users as the unit, a
user who lost a few rows is still there, so the sample-ratio test cannot see it, and the
number of rows per user varies far too much from user to user (and from day to day) for a
3% loss to show in time. The capture proxy records every request it served, errors
included, as a generation event naming its arm (:mod:`rtrl.core.events`); the seal writes
the interactions of an hour once it is complete, with a marker. Over the sealed hours of the
canary, each arm's share of its served requests that reached the shards is then known to
the row; an arm that logged a smaller share than the other (beyond the band
``guardrails.loggedPerServed``) has lost rows, or failed more requests, and either way must
not be promoted.

:func:`logged_per_served` is the guardrail's difference (pure numpy, the benchmark's too);
:func:`count_served` reads the counts from the events store.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rtrl.core.events import SealMarker, seal_marker_key
from rtrl.core.store import ObjectStore
from rtrl_trainer.analyze.estimate import Difference, independent

NAME = "logged_per_served"


def rows_per_share(rows: Any, shares: list[float]) -> Difference:
    """With the request as the unit: each arm's logged rows per unit of traffic share,
    canary against baseline, per step and the steps combined by inverse variance (requests
    are split one by one: binomial variances). ``rows`` is ``[..., 2, S]`` (arm, step)."""
    counts = np.asarray(rows, dtype=np.float64)
    num = np.zeros(counts.shape[:-2])
    den = np.zeros(counts.shape[:-2])
    for s, share in enumerate(shares):
        rb, rc = counts[..., 0, s], counts[..., 1, s]
        with np.errstate(all="ignore"):
            log_ratio = np.log(rc / share) - np.log(rb / (1 - share))
            w = np.where((rb > 0) & (rc > 0), 1 / (1 / rb + 1 / rc), 0.0)
        num += np.where(w > 0, w * log_ratio, 0.0)
        den += w
    with np.errstate(all="ignore"):
        log_ratio = np.where(den > 0, num / den, np.nan)
        var = np.where(den > 0, 1 / den, np.nan)
    base = np.ones(den.shape)
    rows_b, rows_c = counts[..., 0, :].sum(-1), counts[..., 1, :].sum(-1)
    canary = np.exp(log_ratio)
    return independent(base, 0 * base, rows_b, canary, canary * canary * var, rows_c)


def logged_per_served(served_b: Any, logged_b: Any, served_c: Any, logged_c: Any) -> Difference:
    """Each arm's logged rows per served request (binomial variances: requests are logged
    or not one by one), canary against baseline."""
    sb, lb, sc, lc = (np.asarray(v, dtype=np.float64) for v in (served_b, logged_b, served_c,
                                                                logged_c))  # fmt: skip
    with np.errstate(all="ignore"):
        pb = np.where(sb > 0, np.minimum(lb / sb, 1.0), np.nan)
        pc_ = np.where(sc > 0, np.minimum(lc / sc, 1.0), np.nan)
        # a share of exactly 1 has no binomial variance; half a lost row keeps it honest
        vb = np.maximum(pb * (1 - pb), 0.5 / np.maximum(sb, 1)) / sb
        vc = np.maximum(pc_ * (1 - pc_), 0.5 / np.maximum(sc, 1)) / sc
    return independent(pb, vb, sb, pc_, vc, sc)


@dataclass
class Served:
    """What the capture proxy served in the canary's sealed hours: per hour, when it was
    sealed and the requests per checkpoint."""

    by_hour: dict[datetime, Counter[str]] = field(default_factory=dict)
    sealed_at: dict[datetime, datetime] = field(default_factory=dict)
    files: int = 0

    def per_look(
        self, looks: Any, logged: Counter[tuple[int, int]], checkpoints: tuple[str, str]
    ) -> dict[str, np.ndarray]:
        """``served`` and ``logged`` ``[look, arm]``: over the hours sealed by each look
        (``looks.times`` in microseconds), requests served and rows logged per arm
        (``logged`` counts rows by (arm, epoch hour))."""
        times = np.asarray(looks.times, dtype=np.int64)
        served = np.zeros((times.size, 2))
        rows = np.zeros((times.size, 2))
        for hour, counts in self.by_hour.items():
            sealed = _us(self.sealed_at[hour])
            index = _us(hour) // 3_600_000_000
            at = times >= sealed
            for arm, ckpt in enumerate(checkpoints):
                served[at, arm] += counts.get(ckpt, 0)
                rows[at, arm] += logged.get((arm, index), 0)
        return {"served": served, "logged": rows}


def _us(value: datetime) -> int:
    return round(value.timestamp() * 1_000_000)


def sealed_hours(shards: ObjectStore, since: datetime, until: datetime) -> list[datetime]:
    """The hours from ``since``'s to the one before ``until`` whose seal marker exists."""
    found = []
    hour = since.replace(minute=0, second=0, microsecond=0)
    while hour + timedelta(hours=1) <= until:
        if shards.exists(seal_marker_key(hour)):
            found.append(hour)
        hour += timedelta(hours=1)
    return found


def count_served(
    events: ObjectStore, shards: ObjectStore, *, since: datetime, until: datetime,
    checkpoints: tuple[str, ...], org: str | None = None, exclude_orgs: tuple[str, ...] = (),
) -> Served:  # fmt: skip
    """Generation events per checkpoint created in the canary's sealed hours (from
    ``since``, hours sealed before ``until``): the requests each arm served, errors
    included, read from the files the seal's marker lists, each interaction once (a retried
    upload may repeat one); with ``org``, that organisation's alone; never those of
    ``exclude_orgs``."""
    result = Served()
    for hour in sealed_hours(shards, since, until):
        marker = SealMarker.from_json(shards.get_bytes(seal_marker_key(hour)))
        if marker.sealed_at > until:
            continue
        seen: dict[str, set[str]] = {ckpt: set() for ckpt in checkpoints}
        for key in marker.generations:
            result.files += 1
            with events.open_input(key) as stream:
                table = pq.read_table(stream, columns=["interaction_id", "checkpoint_id",
                                                       "created_at", "org"])  # fmt: skip
            created = table.column("created_at")
            inside = pc.and_(
                pc.greater_equal(created, pa.scalar(since, created.type)),
                pc.less(created, pa.scalar(hour + timedelta(hours=1), created.type)),
            )
            if org is not None:
                inside = pc.and_(inside, pc.equal(table.column("org"), org))
            if exclude_orgs:
                left_out = pc.is_in(table.column("org"), value_set=pa.array(exclude_orgs))
                inside = pc.and_(inside, pc.invert(pc.fill_null(left_out, False)))
            for ckpt in checkpoints:
                mine = pc.and_(inside, pc.equal(table.column("checkpoint_id"), ckpt))
                ids = table.column("interaction_id").filter(pc.fill_null(mine, False))
                seen[ckpt].update(i for i in ids.to_pylist() if i is not None)
        result.by_hour[hour] = Counter({ckpt: len(ids) for ckpt, ids in seen.items()})
        result.sealed_at[hour] = marker.sealed_at
    return result
