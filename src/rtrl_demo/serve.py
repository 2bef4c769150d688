"""``python -m rtrl_demo.serve``: the demo's deployment and its users, in one step.

A tick is what a deployment sees in a time window: each arm (the stable checkpoint, and the
canary's for the users the split sends there) is served by the demo's model server behind a
real ``rtrl-capture`` sidecar (:mod:`rtrl_demo.inlet`), the simulated users of
:mod:`rtrl_demo.sim` ask it over HTTP and POST their feedback to a real ``rtrl-feedback``
(:mod:`rtrl_demo.users`). Nothing here writes a shard: the sidecars write generation events,
the feedback service feedback events, and the seal (``rtrl-job seal``, run by the demo as
the operator's CronJob) turns them into the shards the cycles stage.

``--base-out URI`` instead builds the demo's base model: a tiny GPT-2 pre-trained on the
task format (plausible actions, ignorant of the users' preferences), committed like a
checkpoint.

``--requests`` keeps one process up for many of those runs, as a serving fleet stays up
between the demo's ticks: each line on stdin is a JSON request ``{"argv": [...], "log":
PATH}`` (``argv``: this command's arguments), run with its output in ``log``, answered by a
line ``{"exit": N}`` on stdout. torch is imported once, and the arms (model servers and
sidecars) and the feedback service stay up between ticks; an arm no longer named is
stopped as its pod would be (the sidecar drains and ships its events).
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
from .inlet import CLOCK_HEADER, Inlet
from .users import Headers, Visit, interact

PROG = "python -m rtrl_demo.serve"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Simulate users of the serving (and canary) checkpoint for a time window, through "
        "rtrl-capture and rtrl-feedback; or, with --base-out, build the demo's base model."
    )
    parser.add_argument("--base-out", metavar="URI", help="build the base model here and exit")
    parser.add_argument(
        "--events", metavar="URI", help="events root (spec.capture.events) of the feedback"
    )
    parser.add_argument("--serving", metavar="ID=URI", help="the stable checkpoint")
    parser.add_argument(
        "--serving-env", metavar="JSON", help="env of the stable pod's rtrl-capture container"
    )
    parser.add_argument("--canary", metavar="ID=URI", help="the canary checkpoint, if any")
    parser.add_argument(
        "--canary-env", metavar="JSON", help="env of the canary pod's rtrl-capture container"
    )
    parser.add_argument("--work", metavar="DIR", help="spools and logs of the deployment")
    parser.add_argument("--user-header", default="X-Rtrl-User")
    parser.add_argument("--session-header", default="X-Rtrl-Session")
    parser.add_argument("--org-header", default="X-Rtrl-Org")
    parser.add_argument("--canary-share", type=float, default=0.0, help="canary share 0..1")
    parser.add_argument("--users", type=int, default=200, help="simulated users")
    parser.add_argument("--start", metavar="ISO8601", help="start of the window")
    parser.add_argument("--duration", default="1h", help="length of the window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--population-seed", type=int, help="users (default: --seed)")
    parser.add_argument(
        "--orgs",
        help="the users' organisations, comma-separated, as many users in each "
        "(default: the sim's three, drawn at random)",
    )
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


def _interpreted(text: str | None, flag: str) -> dict[str, str]:
    if not text:
        return {}
    env = json.loads(text)
    if not isinstance(env, dict):
        raise ValueError(f"{flag}: expected a JSON object of env values")
    return {str(k): str(v) for k, v in env.items()}


# The deployment this process serves through, kept up across the requests of a
# ``--requests`` fleet: one per process.
_INLETS: list[Inlet] = []


def _inlet(work: Path) -> Inlet:
    if not _INLETS:
        _INLETS.append(Inlet(work, os.environ))
    return _INLETS[0]


def close_inlet() -> None:
    while _INLETS:
        _INLETS.pop().close()


def serve(args: argparse.Namespace) -> int:
    if not (args.events and args.serving and args.start):
        print("rtrl_demo.serve: --events, --serving and --start are required", file=sys.stderr)
        return 2
    start = datetime.fromisoformat(args.start.replace("Z", "+00:00")).astimezone(UTC)
    duration = parse_duration(args.duration)
    arms = [(*_parse_arm(args.serving), "stable", _interpreted(args.serving_env, "--serving-env"))]
    share = args.canary_share if args.canary else 0.0
    if args.canary:
        arms.append((*_parse_arm(args.canary), "canary",
                     _interpreted(args.canary_env, "--canary-env")))  # fmt: skip
    orgs = tuple(o for o in (args.orgs or "").split(",") if o) or sim.ORGS
    users = sim.make_users(
        args.users, args.seed if args.population_seed is None else args.population_seed, orgs
    )
    rng = random.Random(f"serve:{args.seed}:{args.start}")
    # Who interacts, when, with what task, through which arm.
    # The split is by a hash of the user id: the users with the lowest hashes, as many as
    # the canary's share of the population, are in the canary arm.
    ranked = sorted(users, key=lambda u: u.arm_fraction())
    canary_users = (
        {u.user_id for u in ranked[: round(share * len(users))]} if args.canary else set()
    )
    visits: list[Visit] = []
    for user in users:
        n = sum(1 for _ in range(20) if rng.random() < user.rate * duration / 3600 / 20)
        arm = 1 if user.user_id in canary_users else 0
        for _ in range(n):
            created = start + timedelta(seconds=rng.uniform(0, duration))
            visits.append(Visit(user, sim.make_task(rng), created, arm, rng.randrange(2**62)))
    visits.sort(key=lambda v: v.created)
    inlet = _inlet(Path(args.work).resolve() if args.work else Path(tempfile.gettempdir()))
    feedback, token = inlet.feedback_service(args.events)
    with tempfile.TemporaryDirectory() as tmp:
        held = []
        for ckpt, uri, name, pod_env in arms:
            # without the pod's env (a run of this step by hand), the sidecar's essentials
            env = {"RTRL_CAPTURE_EVENTS": args.events, "RTRL_CHECKPOINT_ID": ckpt,
                   "RTRL_MODEL_URI": uri, "RTRL_ARM": name, **pod_env}  # fmt: skip
            held.append(inlet.arm(ckpt, uri, name, env, lambda u: _load(u, Path(tmp))))
    inlet.keep_only({a.key for a in held})
    inlet.follow_table()
    headers = Headers(
        user=args.user_header, session=args.session_header, org=args.org_header,
        clock=CLOCK_HEADER,
    )  # fmt: skip
    served = interact(visits, [(a.url, a.name) for a in held], feedback, token, names=headers)
    inlet.drain()
    for i, a in enumerate(held):
        n = sum(1 for s in served if s.visit.arm == i)
        print(f"served {n} interactions with {a.key[0]} ({a.key[2]}) through {a.url}",
              file=sys.stderr)  # fmt: skip
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
    close_inlet()
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


def main_once(args: argparse.Namespace) -> int:
    """One run in a process of its own: the deployment is stopped when it ends."""
    try:
        return run(args)
    finally:
        close_inlet()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="the demo's model server and users")
    add_arguments(parser)
    return main_once(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
