"""The calibration benchmark computes what ``rtrl-job analyze`` computes: a few simulated
canaries written out as real Parquet shards (every interaction a row, the pre-exposure
history as the stable arm's rows before the canary) and analysed by the real step at
several looks, side by side with the benchmark's own computation on the same canaries.

Run: ``python bench/analysis_agreement.py`` (a few minutes); it prints, per canary and look,
the largest differences between the two (relative changes, their intervals' bounds, the
boundaries) and whether every verdict and decision agrees; exit 1 if any does not.

``--method today --job /path/to/main/.venv/bin/rtrl-job`` checks the calibration's "today"
(mixture intervals, CUPED on each user's own history, nothing else) against the analysis of
another checkout, run as a program: that the "before" figures are the previous code's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from bench.analysis_methods import (  # noqa: E402
    TODAY,
    Analysis,
    LookStats,
    Method,
    SharedBoundaries,
    covariates_of,
)
from bench.analysis_population import (  # noqa: E402
    BLOCK_H,
    BLOG,
    STEPS,
    Canary,
    Look,
    Population,
    draw_users,
    simulate,
)

from rtrl.core.shards import INTERACTION_SCHEMA, write_shards  # noqa: E402
from rtrl_trainer.analyze.covariates import PROMPT_EDGES  # noqa: E402
from rtrl_trainer.analyze.rule import DECISIONS, VERDICTS  # noqa: E402
from rtrl_trainer.cli import main as rtrl_job  # noqa: E402

SINCE = datetime(2026, 1, 5, 0, 0, tzinfo=UTC)
METHODS = {
    "after": Method(
        "group-sequential, predicted, weighted, novelty rule", reconcile=False, weighted=True
    ),
    "today": TODAY,
}
# the prompt length written for each bin: its lower edge (bin 0: 100 tokens)
LENGTHS = (100, *PROMPT_EDGES)


def iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


class Rows:
    """The interactions of one simulated canary, as shard columns."""

    def __init__(self) -> None:
        self.cols: dict[str, list[Any]] = {name: [] for name in INTERACTION_SCHEMA.names}

    def add(self, count: int, **values: Any) -> None:
        for name in INTERACTION_SCHEMA.names:
            v = values.get(name)
            self.cols[name].extend(v if isinstance(v, list) else [v] * count)

    def table(self) -> pa.Table:
        return pa.Table.from_pydict(self.cols, schema=INTERACTION_SCHEMA)


def prompt(length: int) -> list[int]:
    return [1] * length


def write_canary(
    root: Path, users: Any, e: int, blocks: dict[int, list[Any]], pop: Population
) -> None:
    """Canary ``e`` of the simulation as shards under ``root``."""
    rng = np.random.default_rng(1000 + e)
    u = users.rate.shape[1]
    rows = Rows()
    serial = [0]

    def ids(n: int) -> list[str]:
        serial[0] += n
        return [f"i{serial[0] - n + k:09d}" for k in range(n)]

    # the pre-exposure history: each returning user's rows on the stable arm, spread over the
    # day before the canary; their first row has the user's first pre-exposure prompt bin
    pre = users.pre
    for user in range(u):
        n = int(pre["edit_persistence"][2][e, user])
        if n == 0:
            continue
        created = sorted(SINCE - timedelta(seconds=float(s)) for s in
                         rng.uniform(60, pop.pre_hours * 3600 - 60, n))  # fmt: skip
        lengths = [LENGTHS[int(users.pre_first_bin[e, user])]] + [100] * (n - 1)
        values: dict[str, Any] = {}
        for name, column in (("edit_persistence", "edit_persisted"),
                             ("dissatisfied_followup_rate", "dissatisfied_followup"),
                             ("edit_rate", "edits_proposed"),
                             ("clarification_rate", "asked_clarification")):  # fmt: skip
            k = round(float(pre[name][0][e, user]))
            hits = np.zeros(n)
            hits[rng.permutation(n)[:k]] = 1
            values[column] = hits
        lat_sum, lat_xx = float(pre["latency_ms"][0][e, user]), float(pre["latency_ms"][1][e, user])
        latency = np.full(n, lat_sum / n)
        if n >= 2:  # two rows apart so that the sum of squares is the simulated one
            d = math.sqrt(max(lat_xx - lat_sum**2 / n, 0.0) / 2)
            d = min(d, lat_sum / n)
            latency[0] += d
            latency[1] -= d
            pre["latency_ms"][1][e, user] = float(np.sum(latency**2))
        else:
            pre["latency_ms"][1][e, user] = lat_sum**2
        rows.add(
            n, interaction_id=ids(n), checkpoint_id="base", user_id=[f"u{user}"] * n,
            org=str(int(users.org[e, user])), created_at=created,
            feedback_at=[c + timedelta(minutes=20) for c in created],
            prompt_ids=[prompt(k) for k in lengths], completion_ids=[[4, 5]] * n,
            completion_logprobs=[[-0.5, -0.25]] * n, completion_mask=[[True, False]] * n,
            edit_persisted=values["edit_persisted"].tolist(),
            dissatisfied_followup=values["dissatisfied_followup"].astype(bool).tolist(),
            latency_ms=latency.tolist(), tool_calls=0, invalid_tool_calls=0,
            asked_clarification=values["asked_clarification"].astype(bool).tolist(),
            edits_proposed=values["edits_proposed"].astype(int).tolist(),
        )  # fmt: skip
    # the canary: per block, arm and user, the rows the simulation counted
    first_seen: set[int] = set()
    for b in sorted(blocks):
        per: dict[tuple[int, int], dict[str, float]] = {}
        for name, arm, _, flat, values in blocks[b]:
            if name in ("exp", "settled_x", "settled_n", "lat_xx"):
                continue
            mine = flat // u == e
            for i, v in zip((flat[mine] % u).tolist(), np.asarray(values)[mine].tolist(),
                            strict=True):  # fmt: skip
                per.setdefault((arm, i), {})[name] = v
        start = SINCE + timedelta(hours=b * BLOCK_H)
        for (arm, user), v in sorted(per.items()):
            m, miss = int(v.get("m", 0)), int(v.get("fm_x", 0))
            n = m + miss
            if n == 0:
                continue
            created = sorted(start + timedelta(seconds=float(s))
                             for s in rng.uniform(1, BLOCK_H * 3600 - 1, n))  # fmt: skip
            order = rng.permutation(n)
            matured = np.zeros(n, dtype=bool)
            matured[order[:m]] = True
            lengths = [100] * n
            if user not in first_seen:  # the user's first row in the canary: its prompt bin
                first_seen.add(user)
                lengths[0] = LENGTHS[int(users.first_bin[e, user])]
            col: dict[str, np.ndarray] = {}
            for name in ("edit_persistence", "dissatisfied_followup_rate", "edit_rate",
                         "clarification_rate"):  # fmt: skip
                hits = np.zeros(n)
                k = round(float(v.get(name, 0.0)))
                hits[np.flatnonzero(matured)[rng.permutation(m)[:k]]] = 1
                col[name] = hits
            latency = np.where(matured, v.get("latency_ms", 0.0) / max(m, 1), 0.0)
            rows.add(
                n, interaction_id=ids(n), checkpoint_id="cand" if arm else "base",
                user_id=[f"u{user}"] * n, org=str(int(users.org[e, user])), created_at=created,
                feedback_at=[c + timedelta(minutes=30) if ok else None
                             for c, ok in zip(created, matured, strict=True)],
                prompt_ids=[prompt(k) for k in lengths], completion_ids=[[4, 5]] * n,
                completion_logprobs=[[-0.5, -0.25]] * n, completion_mask=[[True, False]] * n,
                edit_persisted=col["edit_persistence"].tolist(),
                dissatisfied_followup=col["dissatisfied_followup_rate"].astype(bool).tolist(),
                latency_ms=latency.tolist(), tool_calls=0, invalid_tool_calls=0,
                asked_clarification=col["clarification_rate"].astype(bool).tolist(),
                edits_proposed=col["edit_rate"].astype(int).tolist(),
            )  # fmt: skip
    write_shards(rows.table(), root, partition_by=("checkpoint",))


def step_args(hours: float) -> list[str]:
    args, start = [], 0.0
    for weight, length in STEPS:
        if start >= hours:
            break
        args += ["--step", f"{iso(SINCE + timedelta(hours=start))}={weight}"]
        start += length or math.inf
    return args


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canaries", type=int, default=2)
    parser.add_argument("--users", type=int, default=1500)
    parser.add_argument("--traffic", type=float, default=3000.0)
    parser.add_argument("--looks", default="3,6,12,24", help="hours")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--method", choices=sorted(METHODS), default="after")
    parser.add_argument("--job", help="an rtrl-job program to run instead of this checkout's")
    args = parser.parse_args()
    looks = [float(h) for h in args.looks.split(",")]
    pop = Population(users=args.users, traffic=args.traffic, pre_hours=24.0)
    canary = Canary("agreement A/B", effect=BLOG)
    e = args.canaries
    rng = np.random.default_rng(args.seed)
    users = draw_users(rng, pop, e)
    covs = None
    blocks: dict[int, list[Any]] = {}
    method = METHODS[args.method]
    analysis = Analysis(method, "user", e, pop.hours)
    seen: dict[float, Any] = {}

    def on_look(look: Look) -> None:
        stats = LookStats(look, "user", covs, shared)
        analysis.look(stats)
        if look.decides and round(look.hours, 6) in looks:
            seen[round(look.hours, 6)] = analysis.last

    shared = SharedBoundaries(e)
    with tempfile.TemporaryDirectory(prefix="rtrl-agreement-") as tmp:
        # the shards first: writing the history settles its latency sums of squares
        simulate(np.random.default_rng(args.seed + 1), pop, canary, e, lambda look: None,
                 users=users, record=blocks.setdefault)  # fmt: skip
        for i in range(e):
            write_canary(Path(tmp) / f"c{i}", users, i, blocks, pop)
        covs = covariates_of(users)
        simulate(np.random.default_rng(args.seed + 1), pop, canary, e, on_look, users=users)
        config = Path(tmp) / "rollout.yaml"
        config.write_text(
            "rollout: {unit: user"
            + (", analysis: {noveltyWindow: 2h}" if method.novelty else "")
            + "}\ndata: {shards: file:///unused/, maxBadFraction: 0.5}\n"
        )
        worst, agree = 0.0, True
        for i in range(e):
            for hours in looks:
                out = Path(tmp) / f"out{i}-{hours:g}"
                now = SINCE + timedelta(hours=hours)
                argv = [
                    "analyze", "--shards", (Path(tmp) / f"c{i}").as_uri() + "/",
                    "--baseline", "base", "--canary", "cand", "--out", out.as_uri() + "/",
                    "--since", iso(SINCE), "--now", iso(now), "--config", str(config),
                    *step_args(hours), *(["--max-duration-reached"] if hours >= 24 else []),
                ]  # fmt: skip
                if args.job:
                    code = subprocess.run([args.job, *argv], check=False).returncode
                else:
                    code = rtrl_job(argv)
                doc = json.loads((out / "analysis.json").read_text())
                assert code == 0, doc["message"]
                diffs, bounds, settled, settled_z, judgement, promote, promote_z = seen[hours]
                largest = 0.0
                rows = {
                    m["name"]: (
                        m,
                        diffs[m["name"]],
                        None if bounds is None else bounds[m["name"]][0],
                    )
                    for m in doc["metrics"]
                }
                if doc.get("settled") is not None:
                    rows["settled"] = (doc["settled"], settled, settled_z)
                weighted = rows["edit_persistence"][0].get("precision_weighted")
                if weighted is not None:
                    rows["weighted"] = (weighted, promote, promote_z)
                lines = []
                for name, (row, d, zs) in rows.items():
                    z = math.nan if zs is None else zs[i]
                    ours = {
                        "relative_difference": math.expm1(float(d.log_ratio[i])),
                        "boundary": float(z) if math.isfinite(z) else None,
                    }
                    if zs is None:  # the mixture's always-valid interval, as judged
                        cmp = judgement.comparisons[name]
                        ours["relative_ci_low"] = float(np.asarray(cmp.rel_low)[i])
                        ours["relative_ci_high"] = float(np.asarray(cmp.rel_high)[i])
                    elif math.isfinite(z):
                        radius = z * math.sqrt(float(d.log_var[i]))
                        ours["relative_ci_low"] = math.expm1(float(d.log_ratio[i]) - radius)
                        ours["relative_ci_high"] = math.expm1(float(d.log_ratio[i]) + radius)
                    for key, value in ours.items():
                        theirs = row.get(key)
                        if value is None or theirs is None:
                            continue
                        largest = max(largest, abs(value - theirs))
                    codes = {
                        "settled": judgement.settled_verdict,
                        "weighted": judgement.promote_verdict,
                    }.get(name, judgement.verdicts.get(name))
                    verdict = VERDICTS[int(np.asarray(codes)[i])]
                    if verdict != row["verdict"]:
                        agree = False
                        lines.append(f"  {name}: verdict {verdict} here, {row['verdict']} there")
                decision = DECISIONS[int(np.asarray(judgement.decision)[i])]
                if decision != doc["decision"]:
                    agree = False
                    lines.append(f"  decision {decision} here, {doc['decision']} there")
                worst = max(worst, largest)
                print(f"canary {i} at {hours:g} h: {doc['decision']} ({doc['message'][:70]}); "
                      f"largest difference {largest:.2e}")  # fmt: skip
                for line in lines:
                    print(line)
        print(f"largest difference over all: {worst:.2e}; verdicts and decisions "
              f"{'all agree' if agree else 'DISAGREE'}")  # fmt: skip
    return 0 if agree and worst < 1e-9 else 1


if __name__ == "__main__":
    sys.exit(main())
