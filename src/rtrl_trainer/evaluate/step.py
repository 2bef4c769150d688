"""The eval step, ``rtrl-job eval``: may this candidate checkpoint be shown to users?

Training can make a checkpoint worse in ways its loss does not show, so before any canary
the candidate runs the RLCycle's eval suites next to its parent (``replay``: the parent's
held-out interactions; ``tasks``: executable coding tasks in a sandbox; ``behaviour``:
generation on held-out prompts) and every metric is compared with a paired bootstrap
(:mod:`.gates`). A gate fails only when the regression beyond its threshold is significant
at ``eval.alpha``.

Either checkpoint may be a LoRA adapter, loaded on its own base (:class:`.model.Checkpoint`).

The verdict is data: the step commits ``eval.json`` (manifest last) and exits 0 whether the
candidate passed or not. It exits 1 only when it could not evaluate (a checkpoint or the
held-out set is missing or corrupt, the task suite is broken, the store fails) and 2 for
usage and configuration errors, each with a one-line message (:mod:`.cli`). The settings
are :mod:`.config`'s, the held-out set and the parent's cache :mod:`.inputs`', the code
and behaviour suites are scored by :mod:`.scoring`.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from rtrl.core.api.checkpoint import GateResult, Verdict
from rtrl.core.api.progress import duration
from rtrl.core.api.rlcycle import EvalSuite
from rtrl.core.results import EvalFailure, EvalResult
from rtrl.core.store import ObjectStore, open_store
from rtrl_trainer.checkpoint_io import InputError
from rtrl_trainer.evaluate import behaviour, replay, sandbox, sandbox_shared, sandbox_types
from rtrl_trainer.evaluate import suite as tasks
from rtrl_trainer.evaluate.config import (
    CACHE_DIR,
    CACHE_FORMAT,
    CODE_SUITES,
    RESULT_NAME,
    EvalConfig,
    EvalError,
    EvaluatorOptions,
)
from rtrl_trainer.evaluate.gates import GateError, Metric, judge
from rtrl_trainer.evaluate.inputs import (
    cache_key,
    cache_stores,
    load_heldout,
    read_cache,
    write_cache,
)
from rtrl_trainer.evaluate.model import Checkpoint, EvalModel, ModelError
from rtrl_trainer.evaluate.scoring import (
    STEP,
    behaviour_metrics,
    run_tasks,
    sandbox_options,
    suite_line,
)
from rtrl_trainer.progress import note, running
from rtrl_trainer.spec_file import ConfigError


def verdict(
    compared: list[dict[str, Any]], unscored: dict[str, dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str], bool, str]:
    """The gates judged (as eval.json records them), those that could not be, the failed
    metrics, whether the candidate passed and the one-line message: a suite not scored
    fails the verdict whatever its gates say."""
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
        message = f"not scored: {', '.join(unscored)}: sandbox guarantee(s) missing: {missing}" + (
            f"; failed gate(s): {', '.join(failed)}" if failed else ""
        )
    elif passed:
        message = f"passed {len(gate_docs)} gate(s) on {len(compared)} metric(s)"
    else:
        message = f"failed gate(s): {', '.join(failed)}"
    return gate_docs, unjudged, failed, passed, message


def _code_suites(
    suites: list[EvalSuite], options: EvaluatorOptions
) -> tuple[dict[str, tasks.Suite], dict[str, dict[str, Any]]]:
    """The code suites asked for, loaded, and those of them the sandbox cannot score here
    (with the guarantees that are missing)."""
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
        except (sandbox_types.SandboxError, ValueError) as exc:
            guarantees = sandbox_types.Guarantees(
                dict.fromkeys(sandbox_shared.GUARANTEES, False), {"all": str(exc)}
            )
        if guarantees.missing():
            for suite_name in code_suites:
                unscored[suite_name] = {"scored": False, **guarantees.to_dict()}
    return code_suites, unscored


def _replay(
    candidate: EvalModel,
    parent: EvalModel,
    table: pa.Table,
    cached_metrics: dict[str, Metric],
    config: EvalConfig,
) -> tuple[list[Metric], list[Metric], dict[str, Any]]:
    """The replay suite: the candidate's and the parent's metrics (the parent's
    log-likelihoods from the cache where it has them) and what eval.json says of it."""
    options = config.options
    refused = replay.Refused()
    rows = replay.rows_from_table(table, limit=options.replay_max_rows, refused=refused)
    if not rows:
        raise EvalError(f"--heldout {config.heldout}: no held-out rows with completion tokens")
    size = len(rows)
    with running(STEP, "replay: KL(candidate || parent)", total=size, unit="rows") as p:
        kl = replay.kl_values(candidate, parent, rows, p)
    with running(STEP, "replay, candidate: log-likelihood", total=size, unit="rows") as p:
        cand = replay.metrics(replay.loglik_values(candidate, rows, p), rows, kl)
    if "replay.loglik" in cached_metrics:
        parent_ll = list(cached_metrics["replay.loglik"].values)
    else:
        with running(STEP, "replay, parent: log-likelihood", total=size, unit="rows") as p:
            parent_ll = replay.loglik_values(parent, rows, p)
    base = replay.metrics(parent_ll, rows, [0.0] * len(rows))
    groups = [r.edit_persisted for r in rows]
    detail = {
        "rows": len(rows),
        "kept": sum(1 for g in groups if g is not None and g >= replay.KEPT),
        "discarded": sum(1 for g in groups if g is not None and g < replay.KEPT),
        # rows whose logged log-probs are not their sampling distribution's: not replayed
        "refused": dict(sorted(refused.by_reason.items())),
    }
    return cand, base, detail


def _behaviour(
    candidate: EvalModel,
    parent: EvalModel | None,
    table: pa.Table,
    cached_metrics: dict[str, Metric],
    config: EvalConfig,
) -> tuple[list[Metric], list[Metric], dict[str, Any]]:
    """The behaviour suite on the first held-out prompts: the candidate's and the parent's
    metrics (the parent's from the cache where it has them all) and what eval.json says."""
    options = config.options
    first = table.column("prompt_ids").to_pylist()[: options.behaviour_max_prompts]
    prompts = [list(p or []) for p in first]
    if not prompts:
        raise EvalError(f"--heldout {config.heldout}: no held-out prompts")
    cand = behaviour_metrics(candidate, prompts, options)
    names = [m.name for m in behaviour.metrics([], [])]
    if all(n in cached_metrics for n in names):
        base = [cached_metrics[n] for n in names]
    else:
        assert parent is not None
        base = behaviour_metrics(parent, prompts, options)
    return cand, base, {"prompts": len(prompts), "tools": sorted(behaviour.TOOLS)}


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
    code_suites, unscored = _code_suites(suites, options)
    with tempfile.TemporaryDirectory(prefix="rtrl-eval-", dir=work_dir) as tmp:
        tmp_dir = Path(tmp)
        start = time.perf_counter()
        try:
            url = config.endpoint_url
            cand_ckpt = Checkpoint.fetch(cand_store, tmp_dir / "candidate", "candidate", url)
            parent_ckpt = Checkpoint.fetch(parent_store, tmp_dir / "parent", "parent", url)
        except InputError as exc:
            raise EvalError(str(exc)) from None
        heldout_table: pa.Table | None = None
        heldout_files: dict[str, str] = {}
        if config.heldout is not None and set(suites) & {EvalSuite.REPLAY, EvalSuite.BEHAVIOUR}:
            heldout_store = _open(config.heldout, "--heldout", config)
            try:
                heldout_table, heldout_files = load_heldout(heldout_store, tmp_dir / "heldout")
            except InputError as exc:
                raise EvalError(str(exc)) from None
        timing["download_seconds"] = time.perf_counter() - start
        note(
            STEP,
            f"fetched the candidate and the parent in {duration(timing['download_seconds'])}; "
            f"suites: {', '.join(str(s) for s in suites)}{cand_ckpt.says('candidate')}"
            f"{parent_ckpt.says('parent')}",
        )
        key = cache_key(config, parent_ckpt.files, heldout_files, code_suites)
        cache_name = f"{CACHE_DIR}/{key}.json"
        stores = cache_stores(config, parent_store)
        cached, cache_uri = read_cache(stores, cache_name)
        cached_metrics = (
            {}
            if cached is None
            else {m["name"]: Metric.from_dict(m) for m in cached.get("metrics", [])}
        )
        try:
            candidate = cand_ckpt.load("candidate")
            need_parent = cached is None or EvalSuite.REPLAY in suites
            parent = parent_ckpt.load("parent") if need_parent else None
        except ModelError as exc:
            raise EvalError(str(exc)) from None
        cand_metrics: list[Metric] = []
        parent_metrics: list[Metric] = []
        details: dict[str, Any] = {}
        for name in suites:
            start = time.perf_counter()
            before = len(cand_metrics)
            if name == EvalSuite.REPLAY:
                assert heldout_table is not None and parent is not None
                cand, base, details["replay"] = _replay(
                    candidate, parent, heldout_table, cached_metrics, config
                )
                cand_metrics += cand
                parent_metrics += base
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
                    suite_line(str(name), [], [], 0.0, unscored[str(name)])
                    continue
                try:
                    metric, per_task, record = run_tasks(candidate, suite, options)
                    if metric.name in cached_metrics and cached is not None:
                        parent_metric = cached_metrics[metric.name]
                        parent_tasks = cached.get("tasks", {}).get(str(name), [])
                    else:
                        assert parent is not None
                        parent_metric, parent_tasks, _ = run_tasks(parent, suite, options)
                except tasks.UnsafeSandboxError as exc:  # a server that held less than the probe
                    unscored[str(name)] = {"scored": False, **exc.guarantees.to_dict()}
                    details[str(name)] = {**head, "sandbox": unscored[str(name)], "results": []}
                    suite_line(str(name), [], [], 0.0, unscored[str(name)])
                    continue
                cand_metrics.append(metric)
                parent_metrics.append(parent_metric)
                for row, prow in zip(per_task, parent_tasks, strict=False):
                    row["parent_status"] = prow.get("status")
                details[str(name)] = {**head, "sandbox": record, "results": per_task}
            else:
                assert heldout_table is not None
                cand, base, details["behaviour"] = _behaviour(
                    candidate, parent, heldout_table, cached_metrics, config
                )
                cand_metrics += cand
                parent_metrics += base
            timing[f"{name}_seconds"] = time.perf_counter() - start
            suite_line(
                str(name),
                cand_metrics[before:],
                parent_metrics[before:],
                timing[f"{name}_seconds"],
                None,
            )
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
            written = write_cache(stores, cache_name, cache_doc)
        gate_docs, unjudged, failed, passed, message = verdict(compared, unscored)
        timing["seconds"] = time.perf_counter() - clock
        doc: dict[str, Any] = {
            "passed": passed,
            "verdict": Verdict.PASSED if passed else Verdict.FAILED,
            "message": message,
            # why it failed, for the Checkpoint's condition: unscored suites first
            "reason": (
                EvalFailure.SANDBOX_UNSAFE
                if unscored
                else EvalFailure.GATES_FAILED
                if failed
                else None
            ),
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
        result = EvalResult.written(doc)  # the contract the operator reads it by
        result_path = tmp_dir / RESULT_NAME
        result_path.write_text(result.to_json())
        out.commit("", {RESULT_NAME: result_path}, {"step": "eval", "passed": passed})
    return result.document()
