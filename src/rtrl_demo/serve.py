"""``python -m rtrl_demo.serve``: the demo's serving fleet and its users, in one step.

Real interactions come from a vLLM Deployment and a logging pipeline; the demo has
neither, so this step samples real completions from the serving checkpoint (and the
canary's, for the users the split sends there), lets the simulated users of
:mod:`rtrl_demo.sim` judge them, and writes the interactions as shard rows with the
serving log-probs, exactly as the logging pipeline would (``checkpoint=<id>/date=/hour=``).

``--base-out URI`` instead builds the demo's base model: a tiny GPT-2 pre-trained on the
task format (plausible actions, ignorant of the users' preferences), committed like a
checkpoint.

``--requests`` keeps one process up for many of those runs, as a serving fleet stays up
between the demo's ticks: each line on stdin is a JSON request ``{"argv": [...], "log":
PATH}`` (``argv``: this command's arguments), run with its output in ``log``, answered by a
line ``{"exit": N}`` on stdout. torch and transformers are imported once instead of for every
tick, most of what a tick of a tiny model costs; the answers are the same as a process per
run would give, since every run seeds its own generators.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import traceback
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

from rtrl.core.api.common import parse_duration
from rtrl.core.store import open_store

from . import sim

PROG = "python -m rtrl_demo.serve"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Simulate users of the serving (and canary) checkpoint for a time window and write "
        "their interactions as shards; or, with --base-out, build the demo's base model."
    )
    parser.add_argument("--base-out", metavar="URI", help="build the base model here and exit")
    parser.add_argument("--shards", metavar="URI", help="shard root to write interactions to")
    parser.add_argument("--serving", metavar="ID=URI", help="the stable checkpoint")
    parser.add_argument("--canary", metavar="ID=URI", help="the canary checkpoint, if any")
    parser.add_argument("--canary-share", type=float, default=0.0, help="canary share 0..1")
    parser.add_argument("--users", type=int, default=200, help="simulated users")
    parser.add_argument("--start", metavar="ISO8601", help="start of the window")
    parser.add_argument("--duration", default="1h", help="length of the window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--population-seed", type=int, help="users (default: --seed)")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument(
        "--requests",
        action="store_true",
        help='run the JSON requests on stdin, one per line: {"argv": [...], "log": PATH}',
    )


def _parse_arm(text: str) -> tuple[str, str]:
    name, sep, uri = text.partition("=")
    if not sep or not name or not uri:
        raise ValueError(f"expected ID=URI, got {text!r}")
    return name, uri


def _torch() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return torch


def build_base(out: str, seed: int, steps: int) -> None:
    """A tiny GPT-2 fitted to :func:`sim.prior_completion` and committed under ``out``."""
    torch = _torch()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2, n_head=2, n_embd=64, vocab_size=sim.VOCAB, n_positions=64,
        bos_token_id=sim.BOS, eos_token_id=sim.EOS,
        # no dropout: a model this small underfits with it, and the policy-gradient step
        # compares log-probs that dropout would make noisy
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # linear decay to zero: the last steps average out the sampling noise of the batches
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / steps)
    rng = random.Random(f"pretrain:{seed}")
    for step in range(steps):
        rows = []
        for _ in range(64):
            task = sim.make_task(rng)
            rows.append((task.prompt, sim.prior_completion(task, rng)))
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, (p, c) in enumerate(rows):
            seq = p + c
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p) : len(seq)] = torch.tensor(c)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"pretrain step {step + 1}/{steps} loss {loss.item():.3f}", file=sys.stderr)
    model.eval()  # type: ignore[no-untyped-call]
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        files = {}
        for path in sorted(Path(tmp).iterdir()):
            os.chmod(path, 0o644)
            files[path.name] = path
        open_store(out).commit("", files, {"kind": "checkpoint", "committedBy": "rtrl_demo.serve"})
    print(f"base model committed to {out}", file=sys.stderr)


def _load(uri: str, tmp: Path) -> Any:
    _torch()
    from transformers import GPT2LMHeadModel

    store = open_store(uri)
    dest = tmp / uuid.uuid4().hex
    dest.mkdir()
    manifest = store.committed("")
    names = (
        list(manifest.files)
        if manifest
        else [i.key for i in store.list("") if not i.key.startswith(("_", "."))]
    )
    for name in names:
        if "/" in name:
            continue
        (dest / name).write_bytes(store.get_bytes(name))
    return GPT2LMHeadModel.from_pretrained(dest).eval()  # type: ignore[no-untyped-call]


def generate(
    model: Any, prompts: list[list[int]], seed: int
) -> list[tuple[list[int], list[float]]]:
    """Sample a completion per prompt (temperature 1, at most MAX_NEW_TOKENS, until EOS) and
    the log-prob of each sampled token: what a serving engine returns and logs."""
    torch = _torch()
    gen = torch.Generator().manual_seed(seed)
    out: list[tuple[list[int], list[float]]] = []
    batch = 256
    with torch.no_grad():
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            # group by length: no padding, no attention masks to get wrong
            by_len: dict[int, list[int]] = {}
            for i, p in enumerate(chunk):
                by_len.setdefault(len(p), []).append(i)
            results: dict[int, tuple[list[int], list[float]]] = {}
            for _, idx in sorted(by_len.items()):
                ids = torch.tensor([chunk[i] for i in idx])
                done = torch.zeros(len(idx), dtype=torch.bool)
                toks: list[list[int]] = [[] for _ in idx]
                lps: list[list[float]] = [[] for _ in idx]
                for _ in range(sim.MAX_NEW_TOKENS):
                    # no KV cache: six tokens of a tiny model, recomputed, are cheaper than
                    # the cache API churn of transformers
                    res = model(input_ids=ids, use_cache=False)
                    logp = torch.log_softmax(res.logits[:, -1].float(), dim=-1)
                    nxt = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
                    chosen = logp.gather(1, nxt[:, None])[:, 0]
                    for j in range(len(idx)):
                        if not done[j]:
                            toks[j].append(int(nxt[j]))
                            lps[j].append(float(chosen[j]))
                    done |= nxt == sim.EOS
                    if bool(done.all()):
                        break
                    ids = torch.cat([ids, nxt[:, None]], dim=1)
                for j, i in enumerate(idx):
                    results[i] = (toks[j], lps[j])
            out.extend(results[i] for i in range(len(chunk)))
    return out


def serve(args: argparse.Namespace) -> int:
    import pyarrow as pa

    from rtrl.core.shards import INTERACTION_SCHEMA, write_shards

    if not (args.shards and args.serving and args.start):
        print("rtrl_demo.serve: --shards, --serving and --start are required", file=sys.stderr)
        return 2
    start = datetime.fromisoformat(args.start.replace("Z", "+00:00")).astimezone(UTC)
    duration = parse_duration(args.duration)
    arms = [_parse_arm(args.serving)]
    share = args.canary_share if args.canary else 0.0
    if args.canary:
        arms.append(_parse_arm(args.canary))
    users = sim.make_users(
        args.users, args.seed if args.population_seed is None else args.population_seed
    )
    rng = random.Random(f"serve:{args.seed}:{args.start}")
    # Who interacts, when, with what task; then each arm answers its users' prompts.
    plan: list[tuple[sim.User, sim.Task, datetime, int]] = []
    # The split is by a hash of the user id: the users with the lowest hashes, as many as
    # the canary's share of the population, are in the canary arm.
    ranked = sorted(users, key=lambda u: u.arm_fraction())
    canary_users = (
        {u.user_id for u in ranked[: round(share * len(users))]} if args.canary else set()
    )
    for user in users:
        n = sum(1 for _ in range(20) if rng.random() < user.rate * duration / 3600 / 20)
        arm = 1 if user.user_id in canary_users else 0
        for _ in range(n):
            created = start + timedelta(seconds=rng.uniform(0, duration))
            plan.append((user, sim.make_task(rng), created, arm))
    plan.sort(key=lambda item: item[2])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for arm, (ckpt, uri) in enumerate(arms):
            mine = [item for item in plan if item[3] == arm]
            if not mine:
                continue
            model = _load(uri, Path(tmp))
            answers = generate(model, [t.prompt for _, t, _, _ in mine], seed=rng.randrange(2**31))
            for (user, task, created, _), (completion, logprobs) in zip(mine, answers, strict=True):
                signals = sim.judge(task, user, completion, rng)
                delay = min(
                    rng.expovariate(1 / sim.FEEDBACK_DELAY_MEAN_S), sim.FEEDBACK_DELAY_MAX_S
                )
                rows.append(
                    {
                        "interaction_id": f"{ckpt}-{uuid.UUID(int=rng.getrandbits(128)).hex}",
                        "checkpoint_id": ckpt,
                        "user_id": user.user_id,
                        "org": user.org,
                        "created_at": created,
                        "feedback_at": created + timedelta(seconds=delay),
                        "prompt_ids": task.prompt,
                        "completion_ids": completion,
                        "completion_logprobs": logprobs,
                        "completion_mask": [True] * len(completion),
                        "task_kind": task.kind,
                        **signals,
                    }
                )
            print(f"served {len(mine)} interactions with {ckpt}", file=sys.stderr)
    if rows:
        schema = INTERACTION_SCHEMA.append(pa.field("task_kind", pa.string()))
        table = pa.Table.from_pylist(rows, schema=schema)
        # One file per partition and window; the window's start in its name keeps files of
        # different windows of the same hour apart (the writer numbers from part-00000).
        tag = start.strftime("%Y%m%dT%H%M%S")
        store = open_store(args.shards)
        with tempfile.TemporaryDirectory() as tmp:
            for key in write_shards(table, tmp):
                store.put_file(key.replace("/part-", f"/part-{tag}-"), Path(tmp) / key)
    return 0


def serve_requests(requests: IO[str]) -> int:
    """``--requests``: run each request's ``argv`` as this command would, in this process,
    its stdout and stderr (the file descriptors, so native libraries' output too) sent to
    its ``log``; answer each on the original stdout, which nothing else writes to."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    parser = argparse.ArgumentParser(prog=PROG)
    add_arguments(parser)
    for line in requests:
        if not line.strip():
            continue
        request = json.loads(line)
        code = _run_request(parser, [str(a) for a in request["argv"]], Path(request["log"]))
        replies.write(json.dumps({"exit": code}) + "\n")
    return 0


def _run_request(parser: argparse.ArgumentParser, argv: list[str], log: Path) -> int:
    saved = os.dup(1), os.dup(2)
    with log.open("ab") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            args = parser.parse_args(argv)
            if args.requests:
                print("rtrl_demo.serve: a request cannot hold --requests", file=sys.stderr)
                return 2
            return run(args)
        except SystemExit as exc:  # argparse's usage errors (2), or an exit of the step's
            return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        except Exception:
            traceback.print_exc()
            return 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run(args: argparse.Namespace) -> int:
    if args.requests:
        return serve_requests(sys.stdin)
    if args.base_out:
        build_base(args.base_out, args.seed, args.pretrain_steps)
        return 0
    return serve(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="the demo's model server and users")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
