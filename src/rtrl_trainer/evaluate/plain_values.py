"""Plain data over a pipe: the only thing a completion's process can hand the grader.

The grader (:mod:`rtrl_trainer.evaluate.grader`) calls a completion's function in another process
and compares what comes back. What comes back must not be able to act: an object whose
``__eq__`` is always True, a ``str`` subclass, anything with methods of the completion's
making. So values cross as JSON of built-in types only, and are rebuilt on the grader's
side from that JSON alone: ``None``, ``bool``, ``int``, ``float`` (also inf and nan),
``str``, ``bytes``, ``complex``, ``list``, ``tuple``, ``dict`` (any plain key), ``set`` and
``frozenset``. Types are checked exactly (``type(v) is int``), so a subclass does not
encode; the completion's side may of course send any bytes it likes, and decoding them
yields plain data or an error, nothing else.

A JSON array is a list; every other container is an object with one tag key. Standard
library only: the sandbox server (``python -I -S``) loads this module too.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

# Nesting deeper than this is not plain test data (and keeps both sides off the C stack).
MAX_DEPTH = 64


class PlainValueError(ValueError):
    """A value that is not plain data, or bytes that do not decode to plain data."""


def encode(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-able data; :class:`PlainValueError` if it is not plain."""
    if depth > MAX_DEPTH:
        raise PlainValueError("nested too deeply")
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is int:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"x": repr(value)}
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"t": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        items = [encode(v, depth + 1) for v in value]
        return {"s" if kind is set else "fs": items}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [encode(value.real, depth + 1), encode(value.imag, depth + 1)]}
    raise PlainValueError(f"not plain data: a {kind.__qualname__}")


def dumps(value: Any) -> bytes:
    return json.dumps(encode(value), allow_nan=False, separators=(",", ":")).encode()


_SPECIAL = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _tagged(doc: dict[str, Any]) -> Any:
    if len(doc) != 1:
        raise PlainValueError("a container must have exactly one tag")
    ((tag, body),) = doc.items()
    if tag == "t" and type(body) is list:
        return tuple(body)
    if tag == "d" and type(body) is list:
        pairs = []
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise PlainValueError("a dict item must be a [key, value] pair")
            pairs.append((pair[0], pair[1]))
        return dict(pairs)
    if tag in ("s", "fs") and type(body) is list:
        return set(body) if tag == "s" else frozenset(body)
    if tag == "x" and body in _SPECIAL:
        return _SPECIAL[body]
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "c" and type(body) is list and len(body) == 2:
        re, im = body
        if type(re) not in (int, float) or type(im) not in (int, float):
            raise PlainValueError("complex parts must be numbers")
        return complex(re, im)
    raise PlainValueError(f"unknown tag {tag[:20]!r}")


def _no_constant(name: str) -> Any:
    raise PlainValueError(f"bare {name} (non-finite floats are tagged)")


def loads(data: bytes) -> Any:
    """Plain data from bytes the other side sent; :class:`PlainValueError` otherwise."""
    try:
        return json.loads(data, object_hook=_tagged, parse_constant=_no_constant)
    except PlainValueError:
        raise
    except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as exc:
        # TypeError: an unhashable set member or dict key; ValueError: bad JSON, an int
        # beyond the digit limit; RecursionError: nesting.
        raise PlainValueError(f"{type(exc).__name__}: {str(exc)[:200]}") from None


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}")


def _outside_strings(data: bytes) -> bytes:
    """JSON ``data`` without the insides of its strings (which may hold any bracket or
    comma): escapes first, then every other quote-delimited piece."""
    if b"\\" in data:
        data = data.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    return b"".join(data.split(b'"')[0::2])


def shape_problem(data: bytes, *, max_items: int, max_depth: int) -> str | None:
    """Why JSON ``data`` is too big to decode (more than ``max_items`` values, or nested
    deeper than ``max_depth``), or None. Counted on the bytes, strings skipped, in a few
    passes of C code: decoding a 16 MB reply of empty lists costs 735 MB, this costs none."""
    bare = _outside_strings(data)
    items = bare.count(b",") + bare.count(b"[") + bare.count(b"{")
    if items > max_items:
        return f"of more than {max_items} items"
    brackets = bare.translate(None, _NOT_BRACKETS)
    depth = 0
    while brackets:  # each pass removes the innermost pairs: the passes are the depth
        depth += 1
        if depth > max_depth:
            return f"nested deeper than {max_depth}"
        shorter = _INNERMOST.sub(b"", brackets)
        if len(shorter) == len(brackets):
            return "that is not JSON (its brackets do not pair)"
        brackets = shorter
    return None
