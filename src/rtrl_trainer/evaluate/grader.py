"""The trusted grader: a suite's tests run here, in the evaluator, never next to the code
they judge.

A pass used to be "the test process exited 0", and a completion shares that process:
``sys.exit(0)``, ``os._exit(0)``, an atexit hook, patching ``assert`` helpers, reading the
tests from the work dir, or returning an object whose ``__eq__`` is always True each
passed. Now the completion only *answers calls*: it is loaded in a sandboxed process
(:meth:`rtrl_trainer.evaluate.sandbox.Sandbox.serve`), and the suite's test code runs in this
process with ``candidate`` bound to a proxy that sends the arguments over a pipe and gets
back plain data (:mod:`rtrl_trainer.evaluate.plain_values`) or the name of an exception. The task
passes when the tests ran to their end here. The completion cannot reach this process
(Landlock, seccomp, a separate user where possible), never sees the tests or the
expected values, and whatever it does to its own process changes only what it answers.

The prompt is executed here too (it is the suite's, trusted): tests may use its helpers
(HumanEval's ``poly``, ``encode_cyclic``).
"""

from __future__ import annotations

import builtins
import time
import traceback
from typing import Any

from rtrl_trainer.evaluate import plain_values
from rtrl_trainer.evaluate.sandbox import Sandbox
from rtrl_trainer.evaluate.sandbox_types import CallTimeout, CandidateGone, Limits, Result


class CandidateRaisedError(Exception):
    """The completion raised an exception whose type is not a built-in one."""


def _raised(doc: dict[str, Any]) -> BaseException:
    """The exception a completion's reply names, rebuilt from plain data: a built-in
    ``Exception`` type by that name (so tests that expect a ``ValueError`` work), else
    :class:`CandidateRaisedError`. Never a BaseException: those belong to the grader."""
    name = str(doc.get("raise", ""))[:100]
    message = str(doc.get("message", ""))[:1000]
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except Exception:
            pass
    return CandidateRaisedError(f"{name}: {message}")


class _Proxy:
    """``candidate`` as the tests see it."""

    def __init__(self, channel: Any, name: str) -> None:
        self._channel = channel
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        reply = self._channel.call(args, kwargs)
        if "value" in reply:
            try:
                return plain_values.loads(plain_values_json(reply["value"]))
            except plain_values.PlainValueError as exc:
                raise CandidateGone(f"a reply that is not plain data: {exc}") from None
        if "raise" in reply:
            raise _raised(reply)
        raise CandidateGone("a reply with neither a value nor an exception")


def plain_values_json(value: Any) -> bytes:
    """The reply's value back to bytes for :func:`plain_values.loads` (which alone decides
    what it becomes)."""
    import json

    return json.dumps(value).encode()


def prompt_code(prompt: str) -> Any:
    """The prompt compiled for its helpers. A prompt may end in a bare signature (the body
    is the completion's): then that function gets a ``pass`` body here."""
    try:
        return compile(prompt, "prompt.py", "exec")
    except SyntaxError:
        return compile(prompt.rstrip("\n") + "\n    pass\n", "prompt.py", "exec")


def grade(
    box: Sandbox,
    *,
    prompt: str,
    completion: str,
    tests: str,
    entry_point: str,
    limits: Limits | None = None,
) -> Result:
    """Load ``prompt + completion`` in ``box`` and run ``tests`` (Python calling
    ``candidate``, or the entry point by name) here against it."""
    limits = limits or Limits()
    start = time.perf_counter()
    outcome, reason = "failed", ""
    with box.serve(prompt + completion, entry_point, limits) as channel:
        try:
            first = channel.ready()
            if "load_error" in first:
                error = first["load_error"]
                outcome = "failed"
                reason = f"did not load: {error.get('raise')}: {error.get('message')}"
            else:
                proxy = _Proxy(channel, entry_point)
                namespace: dict[str, Any] = {"__name__": "__grader__"}
                exec(prompt_code(prompt), namespace)  # the suite's helpers
                namespace[entry_point] = proxy
                namespace["candidate"] = proxy
                exec(compile(tests, "tests.py", "exec"), namespace)
                outcome = "ok"
        except CallTimeout:
            outcome, reason = "timeout", "the wall clock ran out waiting for the completion"
        except CandidateGone as exc:
            outcome, reason = "gone", str(exc) or "the completion's process ended"
        except MemoryError:
            outcome, reason = "memory_limit", "the completion ran out of memory"
        except Exception as exc:
            outcome = "failed"
            reason = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000]
    result = channel.result
    assert result is not None
    process = result.status  # the completion's process, killed at the end by design
    if "error" in result.details:  # the sandbox server itself died
        status = "killed"
    elif outcome == "ok":
        status = "ok"
    elif outcome == "timeout" or process == "timeout":
        status = "timeout"
    elif process in ("cpu_limit", "memory_limit", "output_limit"):
        status = process
    elif outcome == "memory_limit" or "MemoryError" in reason:
        status = "memory_limit"
    else:
        status = "failed"
    result.status = status
    result.seconds = time.perf_counter() - start
    result.details = {**result.details, "calls": channel.calls}
    if reason:
        result.details["reason"] = reason
    if outcome == "gone":
        result.details["exit"] = result.returncode
    return result
