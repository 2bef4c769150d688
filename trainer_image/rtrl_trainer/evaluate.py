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
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field, ValidationError

from rtrl.api.checkpoint import GateResult
from rtrl.api.common import ApiModel
from rtrl.api.rlcycle import EvalSpec, EvalSuite
from rtrl.store import ObjectStore, StoreError, open_store, split_uri
from rtrl_trainer import behaviour, replay, tasks
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
CACHE_FORMAT = 1
HELDOUT_DIR = "heldout"


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
    suite: tasks.Suite | None,
) -> str:
    options = config.options.model_dump(exclude={"resamples", "task_workers"})
    doc = {
        "format": CACHE_FORMAT,
        "parent": parent_files,
        "suites": sorted(str(s) for s in config.spec.suites),
        "heldout": heldout_files,
        "tasks": None if suite is None else [suite.version, suite.sha256, len(suite.tasks)],
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


def _run_tasks(
    model: EvalModel, suite: tasks.Suite, options: EvaluatorOptions
) -> tuple[Metric, list[dict[str, Any]]]:
    completions = _task_completions(model, suite, options)
    results = tasks.run_all(
        suite.tasks, completions, limits=options.limits(), workers=options.task_workers
    )
    per_task = [
        {
            "task_id": t.task_id,
            "status": r.status,
            "seconds": round(r.seconds, 3),
            "isolation": asdict(r.isolation),
        }
        for t, r in zip(suite.tasks, results, strict=True)
    ]
    metric = Metric(
        "tasks.pass_at_1",
        tuple(float(r.passed) for r in results),
        1,
        description="share of tasks whose greedy/sampled completion passes its tests",
    )
    return metric, per_task


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
    suite: tasks.Suite | None = None
    if EvalSuite.TASKS in suites:
        path = Path(options.task_file) if options.task_file else tasks.DEFAULT_SUITE
        try:
            suite = tasks.load_suite(path, limit=options.max_tasks)
        except tasks.SuiteError as exc:
            raise EvalError(str(exc)) from None
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
        key = _cache_key(config, parent_fetched.files, heldout_files, suite)
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
            elif name == EvalSuite.TASKS:
                assert suite is not None
                metric, per_task = _run_tasks(candidate, suite, options)
                cand_metrics.append(metric)
                if metric.name in cached_metrics and cached is not None:
                    parent_metrics.append(cached_metrics[metric.name])
                    parent_tasks = cached.get("tasks", [])
                else:
                    assert parent is not None
                    parent_metric, parent_tasks = _run_tasks(parent, suite, options)
                    parent_metrics.append(parent_metric)
                for row, prow in zip(per_task, parent_tasks, strict=False):
                    row["parent_status"] = prow.get("status")
                isolation = per_task[0]["isolation"] if per_task else {}
                details["tasks"] = {
                    "suite": suite.path.name,
                    "version": suite.version,
                    "sha256": suite.sha256,
                    "tasks": len(suite.tasks),
                    "sandbox": {**isolation, "limits": asdict(options.limits())},
                    "results": per_task,
                }
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
        try:
            compared = judge(
                cand_metrics,
                parent_metrics,
                gates,
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
                "tasks": [
                    {"task_id": r["task_id"], "status": r["parent_status"]}
                    for r in details.get("tasks", {}).get("results", [])
                ],
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
        passed = not failed
        message = (
            f"passed {len(gate_docs)} gate(s) on {len(compared)} metric(s)"
            if passed
            else f"failed gate(s): {', '.join(failed)}"
        )
        timing["seconds"] = time.perf_counter() - clock
        doc: dict[str, Any] = {
            "passed": passed,
            "verdict": "Passed" if passed else "Failed",
            "message": message,
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
    parser.add_argument("--candidate", metavar="URI", required=True, help="candidate checkpoint")
    parser.add_argument("--parent", metavar="URI", required=True, help="parent checkpoint")
    parser.add_argument("--out", metavar="URI", required=True, help="where eval.json is committed")
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


def run(args: argparse.Namespace) -> int:
    """``rtrl-job eval``: build the config, run the step, print a one-line verdict."""
    try:
        if args.work_dir is not None and not args.work_dir.is_dir():
            raise ConfigError(f"--work-dir {args.work_dir}: not a directory")
        config = build_config(
            candidate=args.candidate,
            parent=args.parent,
            out=args.out,
            heldout=args.heldout,
            config_file=args.config,
            endpoint_url=args.endpoint_url,
            max_tasks=args.max_tasks,
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
