"""The demo's deployment (:mod:`rtrl_demo.inlet`): a sidecar that cannot start fails the tick
with its own words, and an arm stopped as its pod is deleted has shipped every event."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rtrl_demo import sim
from rtrl_demo.inlet import Inlet, InletError
from rtrl_demo.scenario import T0
from rtrl_demo.users import Visit, interact

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def tiny(_uri: str) -> Any:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=sim.VOCAB, n_positions=64,
                        bos_token_id=sim.BOS, eos_token_id=sim.EOS)  # fmt: skip
    return GPT2LMHeadModel(config).eval()


def test_a_sidecar_that_cannot_start_fails_with_its_log(tmp_path: Path) -> None:
    inlet = Inlet(tmp_path / "work", ENV)
    try:
        with pytest.raises(InletError) as caught:
            # no RTRL_CAPTURE_EVENTS: rtrl-capture refuses to start (exit 2), naming it
            inlet.arm("demo-0", "file:///models/demo-0/", "stable", {}, tiny)
        assert "rtrl-capture for demo-0 (stable) exited 2" in str(caught.value)
        assert "--events" in str(caught.value)
        assert not inlet.arms and not inlet.servers.runners
    finally:
        inlet.close()


def test_a_retired_arm_has_shipped_every_event(tmp_path: Path) -> None:
    events = (tmp_path / "events").as_uri() + "/"
    uri = (tmp_path / "models" / "demo-0").as_uri() + "/"
    env = {"RTRL_CAPTURE_EVENTS": events, "RTRL_CHECKPOINT_ID": "demo-0",
           "RTRL_MODEL_URI": uri, "RTRL_ARM": "stable"}  # fmt: skip
    # segments would close only after a minute: only the drain on SIGTERM ships them
    inlet = Inlet(tmp_path / "work", ENV, segment_age_s=60.0)
    try:
        feedback, token = inlet.feedback_service(events)
        arm = inlet.arm("demo-0", uri, "stable", env, tiny)
        rng = random.Random(0)
        visits = [
            Visit(u, sim.make_task(rng), T0, 0, i) for i, u in enumerate(sim.make_users(5, 0))
        ]
        served = interact(visits, [(arm.url, arm.name)], feedback, token)
        assert len(served) == 5
        inlet.keep_only(set())  # the pod deleted: SIGTERM, drain, ship
    finally:
        inlet.close()
    files = sorted((tmp_path / "events" / "generations").rglob("*.parquet"))
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    assert sorted(r["interaction_id"] for r in rows) == sorted(s.interaction_id for s in served)
    assert all(r["checkpoint_verified"] for r in rows)
