"""Scoring the suites that generate: the code suites (completions graded in the
sandbox, fail closed) and the behaviour suite (generation on held-out prompts)."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from rtrl.core.store.credentials import CREDENTIALS_DIR_ENV
from rtrl_trainer.evaluate import behaviour, sandbox_types
from rtrl_trainer.evaluate import suite as tasks
from rtrl_trainer.evaluate.config import EvaluatorOptions
from rtrl_trainer.evaluate.gates import Metric
from rtrl_trainer.evaluate.model import EvalModel


def task_completions(model: EvalModel, suite: tasks.Suite, options: EvaluatorOptions) -> list[str]:
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
) -> tuple[list[sandbox_types.Result], dict[str, Any]]:
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
    guarantees = results[0].guarantees if results else sandbox_types.NONE_HELD
    record = {
        **guarantees.to_dict(),
        "insecure": bool(options.insecure_sandbox and guarantees.missing()),
        "limits": asdict(options.limits()),
    }
    return results, record


def run_tasks(
    model: EvalModel, suite: tasks.Suite, options: EvaluatorOptions
) -> tuple[Metric, list[dict[str, Any]], dict[str, Any]]:
    completions = task_completions(model, suite, options)
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


def behaviour_metrics(
    model: EvalModel, prompts: list[list[int]], options: EvaluatorOptions
) -> list[Metric]:
    generated = model.generate(prompts, options.decoding())
    return behaviour.metrics(
        [model.decode(ids) for ids in generated], [len(ids) for ids in generated]
    )
