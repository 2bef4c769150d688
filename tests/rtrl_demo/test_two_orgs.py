"""``rtrl demo --scenario two-orgs``, shortened: two organisations with opposite conventions on
one shared base, each with its own adapter RLCycle (docs/demo.md, "Two organisations").

One cycle per organisation (1000 users, hour-long ticks, a briefly pre-trained base: about
90 s on 2 idle cores). The structural facts: both adapters trained and canaried as routes of
the one routing ConfigMap the base's sidecar follows, the base's pod never restarted (one
arm, one sidecar, the pod template's generation unchanged), each organisation served by its
own adapter once it is promoted and never by the other's. And each adapter improved its own
organisation: on that organisation's users, more of its answers follow the organisation's
convention and more edits persist than under the base (thousands of interactions each, so
that holds in any run; the canary's decision, on fewer, is asserted as a promotion too).
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from rtrl_demo.scenario import T0

SHORT = ["--cycles", "1", "--users", "1000", "--tick-minutes", "60", "--pretrain-steps", "150"]
ORGS = ("org-a", "org-b")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    out = tmp_path_factory.mktemp("two-orgs") / "report"
    rtrl = Path(sys.executable).parent / "rtrl"
    done = subprocess.run(
        [str(rtrl), "demo", *SHORT, "--scenario", "two-orgs", "--quiet", "--out", str(out)],
        check=True,
        timeout=900,
        stderr=subprocess.PIPE,
        text=True,
    )
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return out, summary, done.stderr


def served(out: Path) -> list[dict[str, Any]]:
    """Every sealed interaction: its organisation, checkpoint and time."""
    rows: list[dict[str, Any]] = []
    for path in sorted((out / "store" / "interactions").rglob("*.parquet")):
        table = pq.read_table(path, columns=["org", "checkpoint_id", "created_at"])
        rows += table.to_pylist()
    return rows


def at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@pytest.mark.timeout(1000)
def test_each_org_trains_its_adapter_and_is_served_by_it_on_an_unrestarted_base(
    run: tuple[Path, dict[str, Any], str],
) -> None:
    out, summary, console = run
    cycles = {c["rlcycle"]: c for c in summary["cycles"]}
    assert set(cycles) == {"demo-org-a", "demo-org-b"}, cycles  # the base's RLCycle: none
    routes = summary["routes"]
    # the base never restarted: from the operator's first round (which injected the
    # sidecar) one pod template all along, one arm and sidecar, no canary Deployment
    generations = {r["generation"] for r in routes if at(r["at"]) >= T0}
    assert len(generations) == 1, routes
    assert summary["serving"] == "demo-0"
    assert all(w["canary"] is None for w in summary["canary_weights"])
    logs = out / "work" / "deployment" / "logs"
    assert sorted(p.name for p in logs.glob("rtrl-capture-*.log")) == [
        "rtrl-capture-demo-0-stable.log"
    ]
    rows = served(out)
    for org in ORGS:
        cycle = cycles[f"demo-{org}"]
        adapter = cycle["checkpoint"]
        assert adapter == f"demo-{org}-1" and cycle["parent"] == "demo-0"
        assert cycle["training"], "the adapter was trained"
        # canaried as a route: the org's key named the adapter as canary at the step's weight
        taken = [r["orgs"].get(org) or {} for r in routes]
        assert any((r.get("canary") or {}).get("name") == adapter and r.get("weight") == 50
                   for r in taken), taken  # fmt: skip
        assert cycle["phase"] == "Promoted", cycle["reason"]
        assert (taken[-1].get("stable") or {}).get("name") == adapter, taken[-1]
        assert summary["organisations"][org]["serving"] == adapter
        # after the promotion every request of the org went to its adapter
        promoted = at(cycle["rollout"][-1]["endedAt"])
        mine = [r for r in rows if r["org"] == org]
        after = {r["checkpoint_id"] for r in mine if r["created_at"] >= promoted}
        assert after == {adapter}, after
        # and never a request of the other org
        other = next(o for o in ORGS if o != org)
        theirs = {r["checkpoint_id"] for r in rows if r["org"] == other}
        assert adapter not in theirs and f"demo-{org}-" not in "".join(theirs), theirs
        assert summary["organisations"][org]["served_by_other_orgs_adapters"] == {}
    tail = console[console.index("rtrl demo: summary") :]
    for org in ORGS:
        assert f"{org}: demo-{org}-1 (adapter) vs demo-0 (base)" in tail, tail


@pytest.mark.timeout(1000)
def test_each_adapter_improves_its_own_orgs_metric(run: tuple[Path, dict[str, Any], str]) -> None:
    _, summary, _ = run
    orgs = summary["organisations"]
    for org in ORGS:
        o = orgs[org]
        base, adapter = o["base"], o["adapter"]
        assert base["n"] > 1000 and adapter["n"] > 1000, o
        # its own convention, which the base (trained on nobody's) follows half the time
        assert 0.4 < base["convention"] < 0.6, base
        assert adapter["convention"] > base["convention"] + 0.1, (base, adapter)
        assert adapter["edit_persistence"] > base["edit_persistence"], (base, adapter)
        assert o["improved"] is True
    # the conventions conflict (disjoint halves of the styles): what one org's adapter
    # learned, the other org's users would keep less often than the base's answers
    for org, other in (ORGS, ORGS[::-1]):
        theirs = 1 - orgs[org]["adapter"]["convention"]
        assert theirs < orgs[other]["base"]["convention"], (org, theirs)
