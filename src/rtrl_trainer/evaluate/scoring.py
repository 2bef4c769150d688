"""Scoring the suites that generate: the code suites (completions graded in the
sandbox, fail closed) and the behaviour suite (generation on held-out prompts). Each
generation and grading pass prints its progress (:mod:`rtrl_trainer.progress`), and each
suite its result as soon as it is scored (:func:`suite_line`)."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from rtrl.core.api.progress import duration
from rtrl.core.store.credentials import CREDENTIALS_DIR_ENV
from rtrl_trainer.evaluate import behaviour, sandbox_types
from rtrl_trainer.evaluate import suite as tasks
from rtrl_trainer.evaluate.config import EvaluatorOptions
from rtrl_trainer.evaluate.gates import Metric, value
from rtrl_trainer.evaluate.model import EvalModel
from rtrl_trainer.progress import Progress, emit, running

STEP = "eval"


def task_completions(
    model: EvalModel,
    suite: tasks.Suite,
    options: EvaluatorOptions,
    progress: Progress | None = None,
) -> list[str]:
    prompts = [model.encode(t.prompt) for t in suite.tasks]
    generated = model.generate(prompts, options.decoding(), progress)
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
    progress: Progress | None = None,
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
        progress=progress,
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
    size = len(suite.tasks)
    with running(
        STEP, f"{suite.name}, {model.label}: generating", total=size, unit="problems"
    ) as p:
        completions = task_completions(model, suite, options, p)
    with running(STEP, f"{suite.name}, {model.label}: grading", total=size, unit="problems") as p:
        results, record = score_code(suite, completions, options, progress=p)
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
    what = f"behaviour, {model.label}: generating"
    with running(STEP, what, total=len(prompts), unit="prompts") as p:
        generated = model.generate(prompts, options.decoding(), p)
    return behaviour.metrics(
        [model.decode(ids) for ids in generated], [len(ids) for ids in generated]
    )


def suite_line(
    name: str,
    candidate: list[Metric],
    parent: list[Metric],
    seconds: float,
    unscored: dict[str, Any] | None,
) -> None:
    """A suite's result as soon as it is known (``event: "suite"``): each metric's value
    for the candidate and the parent; the gates are judged once every suite is in."""
    if unscored is not None:
        emit(STEP, "suite", f"{name}: not scored (sandbox guarantee(s) missing)", suite=name)
        return
    values = {
        c.name: {"candidate": value(c), "parent": value(p)}
        for c, p in zip(candidate, parent, strict=True)
    }
    shown = ", ".join(
        f"{metric} {_fmt(v['candidate'])} (parent {_fmt(v['parent'])})"
        for metric, v in values.items()
    )
    emit(
        STEP,
        "suite",
        f"{name}: {shown}; in {duration(seconds)}",
        suite=name,
        seconds=round(seconds, 3),
        metrics=values,
    )


def _fmt(number: float | None) -> str:
    return "-" if number is None else f"{number:.4g}"
