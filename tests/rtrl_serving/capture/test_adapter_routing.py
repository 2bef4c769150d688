"""Adapters ``rtrl-job train`` published, served by the session's real vLLM without a restart,
each organisation's requests sent to its own by the real ``rtrl-capture``.

The base is the engine's tiny model (tests/vllm_engine.py starts the engine with LoRA on).
c1 is org-a's adapter, made by the real steps from what the engine served: org-a's and
org-b's users ask through the real sidecar, their feedback follows, ``rtrl-job seal`` joins
them into shards, ``rtrl-job stage`` keeps org-a's rows alone (``data.population``; its
fidelity gate recomputes the engine's log-probs) and ``rtrl-job train`` trains the adapter
on them. c2 is another of the same base (c1's update reversed, with c1's lineage), b1
org-b's. Then:

- loaded into the running engine (``POST /v1/load_lora_adapter``), an adapter samples with
  the log-probs of PEFT's forward of base + adapter (float32, within 1e-4: the importance
  weights of the rows it served are 1), and the base's requests are untouched;
- the sidecar, given a routing table of one file per organisation (c1 stable and c2 on
  half of org-a's users; b1 for org-b; org-z not in it), downloads them from S3 (moto) and
  loads them itself, sends each org-a user to one arm for good, org-b's to b1 alone, gives
  org-z the pod's checkpoint, tags every event with the adapter and arm that served it
  (whose log-probs are that adapter's), and gives every client the model name it asked for;
- promoting c2 is a change of the file: applied within seconds under load with no failed
  request, c1 unloaded once idle; rolling back to c1 (loaded again) the same; an adapter
  the engine lost (a restarted engine) is loaded again; an adapter trained on another base
  (a promoted base) is not loaded and holds back nothing: the rest of the table is applied,
  its organisations get their stable route or the base, and their events say so.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from rtrl.core.api.adapter import AdapterRef
from rtrl.core.store import MANIFEST_NAME, open_store
from rtrl_serving.capture.adapters import CANARY, STABLE, bucket
from tests.conftest import console_script
from tests.rtrl_serving.capture.events_store import wait_for_events
from tests.rtrl_serving.capture.http import post
from tests.rtrl_serving.conftest import Capture, new_bucket, s3_env, start_capture
from tests.rtrl_trainer.train.test_train_adapter import LEARNING, SHAPE
from tests.vllm_engine import VllmEngine

FLOAT32_TOLERANCE = 1e-4
# what serving needs of the adapters is that they differ: a few steps, no saved state
QUICK = [*LEARNING[:-4], "--max-steps", "2", "--save-every-steps", "0"]
PROMPT = [256, 72, 101, 108, 108, 111]


@dataclass(frozen=True)
class Trained:
    root: Path
    base: Any  # the engine's checkpoint in a plain forward (float32)
    c1: AdapterRef
    c2: AdapterRef
    b1: AdapterRef  # another organisation's
    models: dict[str, Any]  # adapter name -> PEFT model of base + adapter

    def table(self, orgs: dict[str, Any]) -> str:
        return json.dumps({"orgs": orgs})


def _train(env: dict[str, str], parent: str, data: str, out: str, *extra: str) -> None:
    done = subprocess.run(
        [console_script("rtrl-job"), "train", "--parent", parent, "--data", data, "--out", out,
         *extra],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def trained(vllm_engine: VllmEngine, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """c1 trained on the engine's model (rank 4 on q and v), and c2 another adapter of
    the same base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("adapter-routing")
    root = tmp / "bucket"
    store = open_store(root.as_uri() + "/")
    model_dir = vllm_engine.model_dir
    files = {
        p.relative_to(model_dir).as_posix(): p
        for p in model_dir.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME
    }
    store.commit("models/served", files, {"kind": "checkpoint"})
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    env = dict(os.environ, RTRL_SCRATCH=str(tmp / "scratch"))
    keys = ("models/served", "runs/c1/stage", "a/c1", "a/c2", "b/b1")
    uri = {k: (root / k).as_uri() + "/" for k in keys}
    staged = _stage_org_a(vllm_engine, tmp, uri["models/served"], uri["runs/c1/stage"])
    assert staged["interactions_used"] == ORG_A_ASKS, staged  # org-b's rows: none
    gate = staged["fidelity"]  # the engine's log-probs, recomputed from the served base
    assert gate["checked"] and gate["partitions_quarantined"] == 0, gate
    _train(env, uri["models/served"], uri["runs/c1/stage"], uri["a/c1"], *QUICK, *SHAPE)
    _another_adapter(store, "a/c1", "a/c2", scale=-1.0)
    _another_adapter(store, "a/c1", "b/b1", scale=2.0)
    # published where a cluster's are: the session's S3 (moto), beside the base
    bucket = new_bucket(vllm_engine.s3_endpoint)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in s3_env(vllm_engine.s3_endpoint).items():
            if name.startswith("AWS_"):
                mp.setenv(name, value)
        for key in ("a/c1", "a/c2", "b/b1"):
            uri[key] = f"s3://{bucket}/{key}/"
            manifest = store.committed(key)
            assert manifest is not None
            s3 = open_store(uri[key], endpoint_url=vllm_engine.s3_endpoint)
            s3.commit("", {n: root / key / n for n in manifest.files}, manifest.metadata)
    tag = uuid.uuid4().hex[:6]  # the engine is the session's: names of this module alone
    c1 = AdapterRef(name=f"org-a-c1-{tag}", checkpoint=f"org-a-c1-{tag}", uri=uri["a/c1"])
    c2 = AdapterRef(name=f"org-a-c2-{tag}", checkpoint=f"org-a-c2-{tag}", uri=uri["a/c2"])
    b1 = AdapterRef(name=f"org-b-b1-{tag}", checkpoint=f"org-b-b1-{tag}", uri=uri["b/b1"])
    models = {
        ref.name: PeftModel.from_pretrained(copy.deepcopy(base), root / key).eval()
        for ref, key in ((c1, "a/c1"), (c2, "a/c2"), (b1, "b/b1"))
    }
    return Trained(root, base, c1, c2, b1, models)


ORG_A_ASKS, ORG_B_ASKS = 36, 16  # org-a: 12 users x 3; org-b: 8 users x 2


def _stage_org_a(engine: VllmEngine, tmp: Path, base_uri: str, out: str) -> dict[str, Any]:
    """org-a's training set, from what the engine served: both organisations' users ask
    through a sidecar (no routes yet: the base serves all), each answer's edit is kept when
    its first token is even (the users' feedback), the seal joins them, and the stage keeps
    org-a's rows alone; its stage.json."""
    import pyarrow.parquet as pq

    from rtrl.core.store.local import LocalStore
    from rtrl_trainer.cli import main
    from tests.rtrl_trainer.seal.events import feedback, write_events

    events, shards = LocalStore(tmp / "events"), LocalStore(tmp / "shards")
    cap = start_capture(engine.root_url, events.uri, tmp / "capture-spool", dict(os.environ),
                        model_uri=engine.model_uri, extra=["--segment-age-s", "0.3"])  # fmt: skip
    for org, users, rounds in (("org-a", 12, 3), ("org-b", 8, 2)):
        for _ in range(rounds):
            for i in range(users):
                _ask(cap, org, f"{org}-user-{i}")
    assert cap.stop() == 0  # drained: every event shipped
    served = [row for path in sorted((tmp / "events").rglob("*.parquet"))
              for row in pq.read_table(path).to_pylist()]  # fmt: skip
    assert sorted(r["org"] for r in served) == ["org-a"] * ORG_A_ASKS + ["org-b"] * ORG_B_ASKS
    for seq, row in enumerate(served):
        seen = row["created_at"] + timedelta(minutes=1)
        kept = 1.0 if row["completion_ids"][0] % 2 == 0 else 0.0
        write_events(events, "feedback", seen.replace(minute=0, second=0, microsecond=0),
                     [feedback(row["interaction_id"], "edit_persisted", kept, seen)],
                     writer="feedback-0", seq=seq)  # fmt: skip
    final = max(r["created_at"] for r in served) + timedelta(hours=4)
    assert main(["seal", "--events", events.uri, "--shards", shards.uri,
                 "--now", final.isoformat()]) == 0  # fmt: skip
    (tmp / "stage-work").mkdir()
    config = tmp / "rlcycle.yaml"
    config.write_text(json.dumps({"data": {"shards": shards.uri, "population": {"orgs": ["org-a"]}},
                                  "reward": {"editPersisted": 1.0}}))  # fmt: skip
    code = main(["stage", "--checkpoint", "ckpt-1", "--out", out, "--parent", base_uri,
                 "--config", str(config), "--now", final.isoformat(), "--sealed",
                 "--min-interactions", "1", "--min-tokens", "1", "--heldout-fraction", "0",
                 "--work-dir", str(tmp / "stage-work")])  # fmt: skip
    doc: dict[str, Any] = json.loads((Path(out.removeprefix("file://")) / "stage.json").read_text())
    assert code == 0, doc
    return doc


def _another_adapter(store: Any, key: str, out: str, *, scale: float) -> None:
    """c1's adapter with its update scaled (c2: reversed; b1, org-b's: doubled), committed
    with c1's lineage: another adapter of the same base, without a second training run (the
    serving side only needs them to differ; tests/rtrl_trainer/train/test_train_adapter.py
    trains a second cycle)."""
    from safetensors.torch import load_file, save_file

    manifest = store.committed(key)
    source, target = store.root / key, store.root / out
    target.mkdir(parents=True)
    weights = load_file(source / "adapter_model.safetensors")
    save_file({k: scale * t if ".lora_B." in k else t for k, t in weights.items()},
              target / "adapter_model.safetensors")  # fmt: skip
    (target / "adapter_config.json").write_bytes((source / "adapter_config.json").read_bytes())
    files = {n: target / n for n in ("adapter_config.json", "adapter_model.safetensors")}
    store.commit(out, files, {**manifest.metadata, "parent": store.url(key)})


def _engine_post(engine: VllmEngine, path: str, doc: dict[str, Any]) -> tuple[int, str]:
    request = urllib.request.Request(
        engine.root_url + path, data=json.dumps(doc).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _forward(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    logprobs = logits[len(prompt) - 1 : -1].float().log_softmax(-1)
    return [float(logprobs[i, t]) for i, t in enumerate(tokens)]


def _sample(
    engine: VllmEngine, model: str, prompt: list[int], seed: int
) -> tuple[list[int], list[float]]:
    answer = engine.client().completions.create(
        model=model, prompt=prompt, max_tokens=16, temperature=1.0, seed=seed, logprobs=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    return list((choice.model_extra or {})["token_ids"]), list(choice.logprobs.token_logprobs)


def test_the_engine_serves_an_adapter_with_the_trainers_logprobs(
    vllm_engine: VllmEngine, trained: Trained
) -> None:
    name = f"direct-{uuid.uuid4().hex[:6]}"
    load = {"lora_name": name, "lora_path": str(trained.root / "a/c1")}
    status, text = _engine_post(vllm_engine, "/v1/load_lora_adapter", load)
    assert status == 200, text
    try:
        assert name in {m.id for m in vllm_engine.client().models.list().data}
        adapted = trained.models[trained.c1.name]
        generator = torch.Generator().manual_seed(5)
        worst, apart, count = 0.0, 0.0, 0
        for seed in range(6):
            prompt = [256, *torch.randint(32, 127, (10,), generator=generator).tolist()]
            tokens, served = _sample(vllm_engine, name, prompt, seed)
            plain = _forward(trained.base, prompt, tokens)
            for t, e, b in zip(_forward(adapted, prompt, tokens), served, plain, strict=True):
                assert abs(math.exp(t - e) - 1) <= FLOAT32_TOLERANCE
                worst, apart = max(worst, abs(t - e)), max(apart, abs(b - e))
                count += 1
            # the same prompt and seed on the base: the base's own log-probs
            tokens, served = _sample(vllm_engine, vllm_engine.served_model_name, prompt, seed)
            for t, e in zip(_forward(trained.base, prompt, tokens), served, strict=True):
                assert abs(t - e) <= FLOAT32_TOLERANCE
        assert count >= 48 and apart > 100 * FLOAT32_TOLERANCE  # the adapter changes things
        print(f"max |trainer - engine| under the adapter over {count} tokens: {worst:.2e}")
        # an adapter above the engine's --max-lora-rank is refused, and serving goes on
        too_big = trained.root / "too-big"
        too_big.mkdir(exist_ok=True)
        config = json.loads((trained.root / "a/c1/adapter_config.json").read_text())
        (too_big / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
        weights = (trained.root / "a/c1/adapter_model.safetensors").read_bytes()
        (too_big / "adapter_model.safetensors").write_bytes(weights)
        big = {"lora_name": "too-big", "lora_path": str(too_big)}
        status, text = _engine_post(vllm_engine, "/v1/load_lora_adapter", big)
        assert status >= 400, text
        assert _sample(vllm_engine, name, PROMPT, 0)[0]
    finally:
        _engine_post(vllm_engine, "/v1/unload_lora_adapter", {"lora_name": name})


@pytest.fixture(scope="module")
def routed(
    vllm_engine: VllmEngine, trained: Trained, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Capture, Path]]:
    """The sidecar with c1 stable for org-a and c2 on half its users, b1 for org-b (each in
    a file of its own, as each org's RLCycle writes its key), org-z not routed."""
    tmp = tmp_path_factory.mktemp("routed")
    tables = tmp / "tables"
    tables.mkdir()
    table = tables / "org-a.yaml"
    route = {"stable": trained.c1.to_k8s(), "canary": trained.c2.to_k8s(), "weight": 50}
    table.write_text(trained.table({"org-a": route}))
    (tables / "org-b.yaml").write_text(trained.table({"org-b": {"stable": trained.b1.to_k8s()}}))
    moto = vllm_engine.s3_endpoint
    cap = start_capture(
        vllm_engine.root_url, f"s3://{new_bucket(moto)}/events/", tmp / "spool", s3_env(moto),
        model_uri=vllm_engine.model_uri,
        extra=["--segment-age-s", "0.3", "--adapters", str(tables),
               "--adapter-dir", str(tmp / "adapters")],
    )  # fmt: skip
    yield cap, table
    assert cap.stop() == 0


def _ask(cap: Capture, org: str, user: str, model: str = "tiny") -> tuple[str, dict[str, Any]]:
    reply = post(cap.url, "/v1/completions",
                 {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0},
                 {"X-Rtrl-Org": org, "X-Rtrl-User": user})  # fmt: skip
    assert reply.status == 200, reply.body[:500]
    return reply.ids[0], reply.json()


def test_each_orgs_units_are_served_and_tagged_by_their_adapter(
    vllm_engine: VllmEngine, trained: Trained, routed: tuple[Capture, Path]
) -> None:
    cap, _ = routed
    asked: dict[str, tuple[str, str]] = {}  # interaction id -> (org, user)
    for _ in range(2):
        for org, users in (("org-a", 12), ("org-b", 3), ("org-z", 2)):
            for i in range(users):
                interaction, doc = _ask(cap, org, f"user-{i}")
                assert doc["model"] == "tiny"  # what the client asked for, not the adapter
                asked[interaction] = (org, f"user-{i}")
    rows = wait_for_events(vllm_engine.s3_endpoint, cap.events, set(asked))
    arms: dict[str, set[str]] = {}
    for interaction, (org, user) in asked.items():
        (row,) = rows[interaction]
        if org == "org-z":  # not in the table: the pod's own checkpoint and arm
            assert (row["checkpoint_id"], row["arm"]) == ("ckpt-1", "stable")
            continue
        if org == "org-b":  # its own adapter, never org-a's stable or candidate
            arm, ref = STABLE, trained.b1
        else:
            arm = CANARY if bucket(trained.c2.checkpoint, user) < 50 else STABLE
            ref = trained.c2 if arm == CANARY else trained.c1
        assert (row["arm"], row["checkpoint_id"], row["engine_model"]) == (
            arm, ref.checkpoint, ref.name)  # fmt: skip
        assert row["model_uri"] == ref.uri and row["checkpoint_verified"] is True
        if org == "org-a":
            arms.setdefault(user, set()).add(arm)
        # served by that adapter: its log-probs are base + that adapter's
        expected = _forward(trained.models[ref.name], row["prompt_ids"], row["completion_ids"])
        for e, x in zip(row["completion_logprobs"], expected, strict=True):
            assert abs(e - x) <= FLOAT32_TOLERANCE
    assert all(len(a) == 1 for a in arms.values())  # each user in one arm, both rounds
    assert set().union(*arms.values()) == {STABLE, CANARY}
    assert cap.metric("rtrl_capture_adapters_loaded") == 3


def _applied(cap: Capture) -> float:
    return cap.metric("rtrl_capture_adapter_tables_total", result="applied")


def _swap_under_load(cap: Capture, table: Path, doc: str) -> tuple[float, int]:
    """Write ``doc`` as the table while 4 streams of org-a's users ask; (seconds until it
    was applied, requests served), every request answered 200 (else the test fails)."""
    stop, failures, served = threading.Event(), [], [0]

    def load(worker: int) -> None:
        i = 0
        while not stop.is_set():
            try:
                _ask(cap, "org-a", f"load-{worker}-{i % 7}")
                served[0] += 1
            except Exception as exc:  # any failure counts, whatever it is
                failures.append(repr(exc))
            i += 1

    threads = [threading.Thread(target=load, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        before, written = _applied(cap), time.monotonic()
        staged = table.with_suffix(".next")
        staged.write_text(doc)
        os.replace(staged, table)  # as the kubelet swaps a ConfigMap's files
        while _applied(cap) == before:
            assert time.monotonic() - written < 30, "the new table was not applied"
            time.sleep(0.05)
        took = time.monotonic() - written
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failures == [] and served[0] > 10
    return took, served[0]


def _serves(engine: VllmEngine, cap: Capture, ref: AdapterRef) -> None:
    """org-a's user-0 is now served by ``ref``, on the stable arm."""
    interaction, _ = _ask(cap, "org-a", "user-0")
    (row,) = wait_for_events(engine.s3_endpoint, cap.events, {interaction})[interaction]
    assert (row["checkpoint_id"], row["arm"]) == (ref.checkpoint, STABLE)


def test_a_promotion_and_a_rollback_are_file_changes_applied_under_load_with_no_failed_request(
    vllm_engine: VllmEngine, trained: Trained, routed: tuple[Capture, Path]
) -> None:
    cap, table = routed
    took, served = _swap_under_load(
        cap, table, trained.table({"org-a": {"stable": trained.c2.to_k8s()}})
    )
    print(f"promotion applied {took:.2f} s after the file changed; {served} requests, 0 failed")
    assert took < 10
    _serves(vllm_engine, cap, trained.c2)  # every user of org-a, including those c1 served
    deadline = time.monotonic() + 30
    while cap.metric("rtrl_capture_adapters_loaded") != 2:  # c1, idle, is unloaded (c2, b1)
        assert time.monotonic() < deadline, "c1 was not unloaded"
        time.sleep(0.2)
    assert trained.c1.name not in {m.id for m in vllm_engine.client().models.list().data}
    # the rollback: org-a back on c1, which must be loaded again, under the same load
    took, served = _swap_under_load(
        cap, table, trained.table({"org-a": {"stable": trained.c1.to_k8s()}})
    )
    print(f"rollback applied {took:.2f} s after the file changed; {served} requests, 0 failed")
    assert took < 10
    _serves(vllm_engine, cap, trained.c1)
    assert trained.c1.name in {m.id for m in vllm_engine.client().models.list().data}


def test_an_adapter_the_engine_lost_is_loaded_again(
    vllm_engine: VllmEngine, trained: Trained, routed: tuple[Capture, Path]
) -> None:
    """A restarted engine container has no adapter: here c1 (org-a's, since the rollback)
    is unloaded behind the sidecar's back, and the sidecar loads it again within seconds."""
    cap, _ = routed
    reloads = cap.metric("rtrl_capture_adapter_reloads_total")
    status, text = _engine_post(vllm_engine, "/v1/unload_lora_adapter",
                                {"lora_name": trained.c1.name})  # fmt: skip
    assert status == 200, text
    deadline = time.monotonic() + 30
    while trained.c1.name not in {m.id for m in vllm_engine.client().models.list().data}:
        assert time.monotonic() < deadline, "the lost adapter was not loaded again"
        time.sleep(0.2)
    assert cap.metric("rtrl_capture_adapter_reloads_total") == reloads + 1
    interaction, _ = _ask(cap, "org-a", "user-2")
    (row,) = wait_for_events(vllm_engine.s3_endpoint, cap.events, {interaction})[interaction]
    assert (row["checkpoint_id"], row["status"]) == (trained.c1.checkpoint, 200)


def test_an_adapter_of_another_base_is_not_served_and_its_orgs_get_the_base(
    vllm_engine: VllmEngine, trained: Trained, routed: tuple[Capture, Path]
) -> None:
    """org-a's canary and org-c's stable are of another base (stale): the table is applied
    all the same, org-a's users all get its stable c2, org-c gets the pod's base."""
    cap, table = routed
    store = open_store(trained.root.as_uri() + "/")
    manifest = store.committed("a/c2")
    assert manifest is not None
    files = {n: trained.root / "a/c2" / n for n in manifest.files}
    store.commit("a/forged", files, {**manifest.metadata, "baseDigest": "0" * 64})
    forged = AdapterRef(name=f"forged-{uuid.uuid4().hex[:6]}", checkpoint="forged",
                        uri=(trained.root / "a/forged").as_uri() + "/")  # fmt: skip
    before = _applied(cap)
    staged = table.with_suffix(".next")
    route = {"stable": trained.c2.to_k8s(), "canary": forged.to_k8s(), "weight": 100}
    staged.write_text(trained.table({"org-a": route, "org-c": {"stable": forged.to_k8s()}}))
    os.replace(staged, table)
    deadline = time.monotonic() + 30
    while _applied(cap) == before:
        assert time.monotonic() < deadline, "the table was not applied"
        time.sleep(0.1)
    assert forged.name not in {m.id for m in vllm_engine.client().models.list().data}
    assert cap.metric("rtrl_capture_adapters_stale") == 1
    asked = {_ask(cap, org, "user-1")[0]: org for org in ("org-a", "org-c")}
    rows = wait_for_events(vllm_engine.s3_endpoint, cap.events, set(asked))
    for interaction, org in asked.items():
        (row,) = rows[interaction]
        checkpoint = trained.c2.checkpoint if org == "org-a" else "ckpt-1"  # c2, or the base
        assert (row["checkpoint_id"], row["arm"], row["status"]) == (checkpoint, STABLE, 200)
        assert row["engine_model"] != forged.name
    with urllib.request.urlopen(f"{cap.url}/readyz", timeout=5) as ready:
        assert ready.status == 200  # the stale adapter is not waited for
    log = cap.log.read_text()
    assert "trained on base" in log and f"adapter {forged.name}" in log and "stale" in log
