"""The trusted grader: a suite's tests run here, in the evaluator, never next to the code
they judge, and the completion learns nothing from them.

A pass used to be "the test process exited 0", and a completion shares that process:
``sys.exit(0)``, ``os._exit(0)``, an atexit hook, patching ``assert`` helpers, reading the
tests from the work dir, or returning an object whose ``__eq__`` is always True each
passed. Now the completion only *answers calls*: it is loaded in a sandboxed process
(:meth:`rtrl_trainer.evaluate.sandbox.Sandbox.serve`) and gets plain data
(:mod:`rtrl_trainer.evaluate.plain_values`), and answers plain data or the name of an
exception. The task passes when the suite's tests, run here with ``candidate`` bound to
those answers, ran to their end.

**An oracle no more.** Tests stop at their first wrong answer, so a grader that made each
call only when the tests reached it told the completion, by the next call coming or not,
whether its last answer was right: a completion that computed nothing learned is_prime's
answers over a few samples and passed from then on. So the calls are fixed before the
completion answers any: the tests first run here against the suite's own solution (the
*reference run*, :func:`plan`), recording every call it makes; the completion is then sent
every one of those calls, in that order, whatever it answers; only after its task has
ended do the tests run again (the *replay*), each call answered from what the completion
sent. A replay that asks for a call the reference run did not make (the tests took another
path on the completion's answers) fails the task: the completion is never asked. Tests
that draw random inputs get a ``random`` module of their own, seeded from the task, so both
runs draw the same ones.

The completion cannot reach this process (Landlock, seccomp, a separate user where
possible), never sees the tests or the expected values, and whatever it does to its own
process changes only what it answers. The prompt is executed here too (it is the suite's,
trusted): tests may use its helpers (HumanEval's ``poly``, ``encode_cyclic``).
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import json
import random
import time
import traceback
import types
from dataclasses import dataclass
from typing import Any

from rtrl_trainer.evaluate import plain_values
from rtrl_trainer.evaluate.sandbox import Sandbox
from rtrl_trainer.evaluate.sandbox_types import CallTimeout, CandidateGone, Limits, Result


class CandidateRaisedError(Exception):
    """The completion raised an exception whose type is not a built-in one."""


class PlanError(ValueError):
    """The suite's own solution fails its tests: there is no reference run to grade by."""


class _Diverged(BaseException):
    """The replay asked for a call the reference run did not make (a BaseException: the
    tests must not catch it)."""


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


def _encode_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """A call as the bytes the completion is sent (and the replay compares)."""
    encoded = [plain_values.encode(list(args)), plain_values.encode(kwargs)]
    return json.dumps(encoded, allow_nan=False, separators=(",", ":")).encode()


def _plain_copy(value: Any) -> Any:
    """``value`` as it would come back over the pipe: rebuilt from plain data."""
    return plain_values.loads(plain_values.dumps(value))


def prompt_code(prompt: str) -> Any:
    """The prompt compiled for its helpers. A prompt may end in a bare signature (the body
    is the completion's): then that function gets a ``pass`` body here."""
    try:
        return compile(prompt, "prompt.py", "exec")
    except SyntaxError:
        return compile(prompt.rstrip("\n") + "\n    pass\n", "prompt.py", "exec")


def _seeded_random(seed: int) -> types.ModuleType:
    """A ``random`` module of the tests' own: its functions draw from ``Random(seed)``."""
    rng = random.Random(seed)
    module = types.ModuleType("random")
    for name in dir(random):
        value = getattr(random, name)
        if getattr(value, "__self__", None) is getattr(random, "_inst", None):
            value = getattr(rng, name)
        module.__dict__[name] = value
    return module


def _namespace(prompt: str, seed: int) -> dict[str, Any]:
    """Where the tests run: the prompt's helpers, and ``import random`` gives a module
    seeded from the task (threads grading other tasks share no random state with it)."""
    private = _seeded_random(seed)
    real_import = builtins.__import__

    def import_(
        name: str,
        globals: Any = None,  # __import__'s own names
        locals: Any = None,
        fromlist: Any = (),
        level: int = 0,
    ) -> Any:
        if name == "random" and level == 0:
            return private
        return real_import(name, globals, locals, fromlist, level)

    namespace: dict[str, Any] = {
        "__name__": "__grader__",
        "__builtins__": {**vars(builtins), "__import__": import_},
    }
    exec(prompt_code(prompt), namespace)  # the suite's helpers
    return namespace


@dataclass(frozen=True)
class Plan:
    """The calls the tests make with the suite's solution, in order, as sent."""

    calls: tuple[bytes, ...]
    seed: int


class _Reference:
    """``candidate`` in the reference run: the suite's solution, called on plain copies of
    the arguments, answering plain copies (exceptions by name), as a completion would."""

    def __init__(self, function: Any) -> None:
        self._function = function
        self.calls: list[bytes] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = _encode_call(args, kwargs)
        self.calls.append(call)
        decoded_args, decoded_kwargs = plain_values.loads(call)
        try:
            value = self._function(*decoded_args, **decoded_kwargs)
        except Exception as exc:
            raise _raised({"raise": type(exc).__name__, "message": str(exc)}) from None
        return _plain_copy(value)


@functools.lru_cache(maxsize=4096)
def plan(prompt: str, tests: str, entry_point: str, solution: str) -> Plan:
    """The reference run (module docstring): the tests against the suite's ``solution``;
    the calls they made. Cached: every sample of a task is sent the same calls."""
    seed = int.from_bytes(hashlib.sha256(tests.encode()).digest()[:8], "big")
    own: dict[str, Any] = {"__name__": "__reference__"}
    exec(compile(prompt + solution, "solution.py", "exec"), own)
    reference = _Reference(own[entry_point])
    namespace = _namespace(prompt, seed)
    namespace[entry_point] = namespace["candidate"] = reference
    try:
        exec(compile(tests, "tests.py", "exec"), namespace)
    except Exception as exc:
        why = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:500]
        raise PlanError(f"{entry_point}: the suite's solution fails its own tests: {why}") from None
    return Plan(tuple(reference.calls), seed)


_TIMEOUT: Any = object()  # a reply that never came: the wall clock ran out


class _Replay:
    """``candidate`` in the replay: the i-th call is answered by the completion's i-th
    reply, if it is the reference run's i-th call."""

    def __init__(self, plan: Plan, replies: list[Any]) -> None:
        self._plan = plan
        self._replies = replies
        self._next = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        index = self._next
        self._next += 1
        call = _encode_call(args, kwargs)
        if index >= len(self._plan.calls) or call != self._plan.calls[index]:
            raise _Diverged(
                f"call {index + 1}: the tests took another path on the completion's answers "
                "than on the suite's solution"
            )
        reply = self._replies[index]
        if reply is _TIMEOUT:
            raise CallTimeout
        if isinstance(reply, CandidateGone):
            raise CandidateGone(*reply.args)
        if "value" in reply:
            try:
                return plain_values.loads(json.dumps(reply["value"]).encode())
            except plain_values.PlainValueError as exc:
                raise CandidateGone(f"a reply that is not plain data: {exc}") from None
        if "raise" in reply:
            raise _raised(reply)
        raise CandidateGone("a reply with neither a value nor an exception")


def _ask(channel: Any, calls: tuple[bytes, ...]) -> list[Any]:
    """Every call, in order, whatever the answers; a reply per call up to the first the
    completion did not answer (then the reason: it timed out or is gone)."""
    replies: list[Any] = []
    for call in calls:
        try:
            replies.append(channel.call(call))
        except CallTimeout:
            replies.append(_TIMEOUT)
            break
        except CandidateGone as exc:
            replies.append(exc)
            break
    return replies


def grade(
    box: Sandbox,
    *,
    prompt: str,
    completion: str,
    tests: str,
    entry_point: str,
    solution: str,
    limits: Limits | None = None,
) -> Result:
    """Load ``prompt + completion`` in ``box``, send it every call the ``tests`` (Python
    calling ``candidate``, or the entry point by name) make against the suite's
    ``solution``, then run the tests here on its answers."""
    limits = limits or Limits()
    start = time.perf_counter()
    calls = plan(prompt, tests, entry_point, solution)
    outcome, reason = "failed", ""
    replies: list[Any] = []
    with box.serve(prompt + completion, entry_point, limits) as channel:
        try:
            first = channel.ready()
            if "load_error" in first:
                error = first["load_error"]
                reason = f"did not load: {error.get('raise')}: {error.get('message')}"
            else:
                replies = _ask(channel, calls.calls)
                outcome = "answered"
        except CallTimeout:
            outcome, reason = "timeout", "the wall clock ran out waiting for the completion"
        except CandidateGone as exc:
            outcome, reason = "gone", str(exc) or "the completion's process ended"
    if outcome == "answered":  # the task has ended: the tests run on what it sent
        outcome, reason = _replay(prompt, tests, entry_point, calls, replies)
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


def _replay(
    prompt: str, tests: str, entry_point: str, calls: Plan, replies: list[Any]
) -> tuple[str, str]:
    """Run the tests on the completion's replies: (outcome, reason)."""
    proxy = _Replay(calls, replies)
    namespace = _namespace(prompt, calls.seed)
    namespace[entry_point] = namespace["candidate"] = proxy
    try:
        exec(compile(tests, "tests.py", "exec"), namespace)
    except CallTimeout:
        return "timeout", "the wall clock ran out waiting for the completion"
    except CandidateGone as exc:
        return "gone", str(exc) or "the completion's process ended"
    except _Diverged as exc:
        return "failed", str(exc)
    except MemoryError:
        return "memory_limit", "the completion ran out of memory"
    except Exception as exc:
        return "failed", "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000]
    return "ok", ""
