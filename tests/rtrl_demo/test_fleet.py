"""The demo's serving fleet (``python -m rtrl_demo.serve --requests`` behind
:class:`rtrl_demo.fleet.ServingFleet`): one process answers many ticks through the inlet, each
as a process of its own would, and a bad or crashed request fails that request only."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rtrl_demo.fleet import SERVE, ServingFleet

ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def events(root: Path, kind: str) -> list[dict[str, object]]:
    """The events of ``kind`` (generations, feedback) under an events root, without what
    differs between runs by design: the ids the sidecar mints (UUIDv7: the serving time and
    random bits), the writer, the pod and the real-time latency."""
    files = sorted((root / kind).rglob("*.parquet"))
    assert files, f"no {kind} events under {root}"
    varying = {"interaction_id", "event_id", "pod", "latency_ms", "received_at", "writer"}
    out = []
    for path in files:
        for row in pq.read_table(path).to_pylist():
            out.append({k: v for k, v in row.items() if k not in varying})
    return sorted(out, key=lambda r: repr({k: v for k, v in r.items() if k not in FLOATS}))


# Log-probs are compared to a few float32 ulps: the engine batches whatever requests arrive
# while a batch runs, so a request's batch differs between runs, and a matmul over another
# batch shape sums in another order (CI saw -5.580204010 against -5.580203533). The tokens,
# sampled by each request's own seeded generator, must still be the same.
FLOATS = {"completion_logprobs"}


def assert_same_events(got: list[dict[str, object]], want: list[dict[str, object]]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert {k: v for k, v in a.items() if k not in FLOATS} == {
            k: v for k, v in b.items() if k not in FLOATS
        }
        for k in FLOATS & a.keys():
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k


def test_ticks_served_by_the_fleet_equal_a_process_per_tick(tmp_path: Path) -> None:
    """Every user's request goes through the real rtrl-capture and their feedback through
    rtrl-feedback; the events are the same whether one fleet serves the ticks or a process
    each does (each request's sampling and judgement are seeded by the request)."""
    fleet = ServingFleet(ENV, tmp_path / "fleet")
    base = (tmp_path / "store" / "base").as_uri() + "/"
    try:
        built = fleet.run([f"--base-out={base}", "--pretrain-steps=3"], tmp_path / "base.log")
        assert built.exit_code == 0, built.message
        tick = [f"--serving=demo-0={base}", "--users=40", "--start=2026-01-05T06:00:00Z",
                "--duration=3600s", "--seed=5"]  # fmt: skip
        first = fleet.run([f"--events={(tmp_path / 'a').as_uri()}/", *tick], tmp_path / "a.log")
        assert first.exit_code == 0, first.message
        assert "served" in (tmp_path / "a.log").read_text()
    finally:
        fleet.close()
    alone = subprocess.run(
        [*SERVE, f"--events={(tmp_path / 'c').as_uri()}/", f"--work={tmp_path / 'w'}", *tick],
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
        check=False,
    )
    assert alone.returncode == 0, alone.stderr
    for kind in ("generations", "feedback"):
        assert_same_events(events(tmp_path / "a", kind), events(tmp_path / "c", kind))
    served = events(tmp_path / "a", "generations")
    assert {r["checkpoint_id"] for r in served} == {"demo-0"}
    assert all(r["checkpoint_verified"] and r["completion_logprobs"] for r in served)


def test_a_bad_request_fails_alone_and_a_dead_fleet_is_restarted(tmp_path: Path) -> None:
    fleet = ServingFleet(ENV, tmp_path / "fleet")
    try:
        missing = fleet.run(["--users=3"], tmp_path / "missing.log")
        assert missing.exit_code == 2
        assert "--events, --serving and --start are required" in missing.message
        unknown = fleet.run(["--no-such-flag"], tmp_path / "unknown.log")
        assert unknown.exit_code == 2 and "unrecognized arguments" in unknown.message
        nested = fleet.run(["--requests"], tmp_path / "nested.log")
        assert nested.exit_code == 2 and "cannot hold --requests" in nested.message
        first = fleet.proc
        assert first is not None and first.poll() is None, "still the same process"

        # Killed mid-request (an OOM kill, say): that request fails, naming the fleet.
        slow = ["--base-out=" + (tmp_path / "slow").as_uri() + "/", "--pretrain-steps=100000"]
        threading.Timer(3.0, lambda: os.kill(first.pid, signal.SIGKILL)).start()
        killed = fleet.run(slow, tmp_path / "slow.log")
        assert killed.exit_code == 1 and "the serving fleet exited -9" in killed.message
        again = fleet.run(["--users=3"], tmp_path / "again.log")
        assert again.exit_code == 2 and fleet.proc is not first
    finally:
        fleet.close()
    assert fleet.proc is None
