"""A user's manifest file read as Kubernetes reads it, within bounds.

``yamlfile`` reads YAML the project trusts; a file handed to ``rtrl validate`` may be
hostile or broken, and must cost bounded time and memory and end in a one-line problem,
never a traceback. So this reader builds the JSON value of each document from PyYAML's
event stream (libyaml's parser where PyYAML has it) and refuses, with the field path and
the line:

- more than ``MAX_NODES`` values in one document, aliases expanded: a 400-byte "billion
  laughs" file expands to millions of values, and every later pass would pay for them;
- nesting deeper than ``MAX_DEPTH``: every validator recurses, and no rtrl field is
  nested more than a few levels;
- a key given twice in one mapping: the API server refuses it in a YAML body, while
  kubectl's client keeps the last one without a word;
- anything that is not JSON: ``!!binary``, ``!!set``, ``!!omap`` and custom tags (which
  kubectl would quietly turn into strings or maps), integers outside int64, ``.inf`` and
  ``.nan`` (kubectl fails on them), non-scalar or null keys.

Plain scalars resolve as kubectl and the API server resolve them (``kube_scalars``), not
as PyYAML does; keys that are numbers or booleans become their text, as sigs.k8s.io/yaml
makes them; merge keys (``<<: *base``) work. The file's size is capped first
(``manifest_text``: ``MAX_BYTES``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml

from .errors import format_loc
from .kube_scalars import TAG as _TAG
from .kube_scalars import resolve as _resolve

MAX_BYTES = 3 * 2**20  # the API server refuses a request body over 3 MiB
MAX_NODES = 50_000
MAX_DEPTH = 64
INT64 = (-(2**63), 2**63 - 1)

_SCALAR_TAGS = {_TAG + t for t in ("str", "int", "float", "bool", "null", "timestamp")}
_COLLECTION_TAGS = {yaml.MappingStartEvent: _TAG + "map", yaml.SequenceStartEvent: _TAG + "seq"}
_PARSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: ~10x faster


@dataclass(frozen=True)
class YamlProblem:
    """Why a document was refused: where (a field path, a line) and what."""

    path: str
    line: int  # 1-based; 0 when unknown
    message: str

    @property
    def located(self) -> str:
        """The message with its line: ``line 8: duplicate key (first at line 7)``."""
        return f"line {self.line}: {self.message}" if self.line else self.message


@dataclass(frozen=True)
class Refused:
    """One document of a file refused when read: which, and why."""

    index: int  # position in the file (0-based)
    problem: YamlProblem


@dataclass(frozen=True)
class Loaded:
    """One document of a file and its JSON value."""

    index: int
    body: Any


def manifest_text(data: bytes) -> str:
    """A file's bytes as text: over ``MAX_BYTES`` (the API server's request limit) or not
    UTF-8, a ValueError in one line."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES // 2**20} MiB, the API server's request limit")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (byte {exc.start})") from None


def load_manifests(text: str) -> Iterator[Loaded | Refused]:
    """The documents of ``text``, each a JSON value (dict, list, str, int, float, bool or
    None) or a problem. A document refused for what it holds does not stop the next ones;
    one refused for its size, or a syntax error, ends the file (reading on would cost what
    the bounds are there to save). Empty documents are left out."""
    events = yaml.parse(text, Loader=_PARSER)
    index = -1
    try:
        for event in events:
            if not isinstance(event, yaml.DocumentStartEvent):
                continue
            index += 1
            try:
                body = _Builder().document(events)
            except _RefusedError as refused:
                yield Refused(index, refused.problem)
                if refused.final:
                    return
                for rest in events:  # on to the next document
                    if isinstance(rest, yaml.DocumentEndEvent):
                        break
                continue
            if body is not None:
                yield Loaded(index, body)
    except yaml.YAMLError as exc:
        yield Refused(max(index, 0), syntax_problem(exc))


def syntax_problem(exc: yaml.YAMLError) -> YamlProblem:
    """A YAML syntax error on one line: what, where, and in which construct."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        message = f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
        if exc.context and exc.context_mark is not None:
            message += f" ({exc.context} at line {exc.context_mark.line + 1})"
        return YamlProblem("", 0, f"not valid YAML: {message}")
    return YamlProblem("", 0, f"not valid YAML: {' '.join(str(exc).split())}")


class _RefusedError(Exception):
    def __init__(self, problem: YamlProblem, *, final: bool = False) -> None:
        super().__init__(problem.message)
        self.problem = problem
        self.final = final  # a size bound: the rest of the file is not read


_NO_KEY = object()
_MERGE_KEY = object()


@dataclass
class _Frame:
    """An open mapping or sequence: what it holds so far, and what its next event is."""

    value: Any  # dict or list
    key: str | int | None  # its key (or index) in its parent
    anchor: str | None
    size: int = 1  # values in it, itself included, aliases expanded
    height: int = 1  # levels of collections, itself included (a scalar's is 0)
    pending: Any = _NO_KEY  # a mapping's key awaiting its value
    lines: dict[str, int] = field(default_factory=dict)  # first line of each key
    merges: list[dict[str, Any]] = field(default_factory=list)


class _Builder:
    """One document's JSON value from its events, refusing what ``load_manifests`` says."""

    def __init__(self) -> None:
        self.stack: list[_Frame] = []
        self.anchors: dict[str, tuple[Any, int, int]] = {}  # value, size, height
        self.total = 0
        self.root: Any = None

    def document(self, events: Iterator[yaml.Event]) -> Any:
        for event in events:
            line = event.start_mark.line + 1 if event.start_mark else 0
            if isinstance(event, yaml.ScalarEvent):  # the commonest first
                value, merge_key = self._scalar(event, line)
                self._anchor(event.anchor, value, 1, 0)
                self._add(value, 1, 0, line, merge_key=merge_key)
            elif isinstance(event, yaml.AliasEvent):
                self._alias(event.anchor or "", line)
            elif isinstance(event, yaml.MappingStartEvent | yaml.SequenceStartEvent):
                self._open(event, line)
            elif isinstance(event, yaml.MappingEndEvent | yaml.SequenceEndEvent):
                frame = self.stack.pop()
                value = self._finish(frame)
                self._anchor(frame.anchor, value, frame.size, frame.height)
                self._place(value, frame.size, frame.height, line)
            elif isinstance(event, yaml.DocumentEndEvent):
                return self.root
        raise _RefusedError(YamlProblem("", 0, "the document ends early"))

    # --- where we are -------------------------------------------------------------------

    def _path(self, extra: tuple[str | int, ...] = ()) -> str:
        keys = [f.key for f in self.stack[1:] if f.key is not None]
        return format_loc((*keys, *extra))

    def _here(self) -> tuple[str | int, ...]:
        """The path element the next value takes in the innermost open collection."""
        if not self.stack:
            return ()
        top = self.stack[-1]
        if isinstance(top.value, list):
            return (len(top.value),)
        return (top.pending,) if isinstance(top.pending, str) else ()

    def _refuse(
        self, line: int, message: str, extra: tuple[str | int, ...] = (), *, final: bool = False
    ) -> _RefusedError:
        return _RefusedError(YamlProblem(self._path(extra), line, message), final=final)

    # --- values ---------------------------------------------------------------------------

    def _scalar(self, event: yaml.ScalarEvent, line: int) -> tuple[Any, bool]:
        """The value of a scalar, and whether it is a merge key (``<<``, plain)."""
        text, tag = event.value, event.tag
        if tag in (None, "!") and not event.implicit[0]:  # quoted, or tagged "!"
            return text, False
        if tag not in (None, *_SCALAR_TAGS):
            raise self._not_json(str(tag), line)
        if tag in (_TAG + "str", _TAG + "timestamp"):
            return text, False
        if tag is None and text == "<<":
            return text, True
        kind, value = _resolve(text)
        if tag is not None and kind != tag and not (kind == _TAG + "int" and tag == _TAG + "float"):
            wanted = tag.removeprefix(_TAG)
            raise self._refuse(line, f"{_short(text)!r} is not a valid !!{wanted}", self._here())
        if kind == _TAG + "int" and not INT64[0] <= value <= INT64[1]:
            raise self._refuse(
                line,
                f"integer {_short(text)} is out of range: Kubernetes stores 64-bit integers",
                self._here(),
            )
        if kind == _TAG + "float" and not math.isfinite(value):
            raise self._refuse(line, f"{_short(text)} is not a JSON number", self._here())
        return (float(value) if tag == _TAG + "float" else value), False

    def _not_json(self, tag: str, line: int) -> _RefusedError:
        shown = tag.replace(_TAG, "!!", 1)
        return self._refuse(
            line,
            f"the tag {_short(shown)} is not accepted: a manifest holds only strings, numbers, "
            "booleans, null, lists and maps (JSON)",
            self._here(),
        )

    def _alias(self, anchor: str, line: int) -> None:
        if any(f.anchor == anchor for f in self.stack):
            raise self._refuse(line, f"the alias *{_short(anchor)} refers to itself", self._here())
        if anchor not in self.anchors:
            raise self._refuse(line, f"the alias *{_short(anchor)} is not defined", self._here())
        value, size, height = self.anchors[anchor]
        if self.total + size > MAX_NODES:
            raise self._refuse(
                line,
                f"the alias *{_short(anchor)} expands to {size:,} values, which takes the "
                f"document past the {MAX_NODES:,} it may hold",
                self._here(),
                final=True,
            )
        self._add(value, size, height, line)

    def _anchor(self, anchor: str | None, value: Any, size: int, height: int) -> None:
        if anchor is not None:  # a later anchor of the same name replaces it, as in YAML
            self.anchors[anchor] = (value, size, height)

    def _open(self, event: yaml.MappingStartEvent | yaml.SequenceStartEvent, line: int) -> None:
        tag = event.tag
        if tag not in (None, "!", _COLLECTION_TAGS[type(event)]):
            raise self._not_json(str(tag), line)
        if self.stack and isinstance(self.stack[-1].value, dict):
            top = self.stack[-1]
            if top.pending is _NO_KEY:
                raise self._refuse(line, "a key must be a string, not a list or a mapping")
        if len(self.stack) >= MAX_DEPTH:
            raise self._refuse(
                line, f"nested deeper than {MAX_DEPTH} levels", self._here(), final=True
            )
        self._count(1, line)
        here = self._here()
        key = here[0] if here else None
        value: Any = {} if isinstance(event, yaml.MappingStartEvent) else []
        self.stack.append(_Frame(value, key, event.anchor))

    def _finish(self, frame: _Frame) -> Any:
        if not frame.merges:
            return frame.value
        merged: dict[str, Any] = {}
        for source in reversed(frame.merges):
            merged.update(source)
        merged.update(frame.value)
        return merged

    # --- placing a value in its collection -------------------------------------------------

    def _count(self, size: int, line: int) -> None:
        """Count values; past ``MAX_NODES``, blame the innermost open collection that holds
        most of the document (``spec.rollout.steps`` with 50,000 steps)."""
        self.total += size
        if self.total <= MAX_NODES:
            return
        inner = 0
        held = self.total
        for depth in range(len(self.stack)):
            if held * 2 <= self.total:
                break
            inner = depth
            held -= self.stack[depth].size
        culprit = self.stack[inner] if self.stack else None
        path = format_loc([f.key for f in self.stack[1 : inner + 1] if f.key is not None])
        message = f"more than {MAX_NODES:,} values in one document"
        if culprit is not None:
            what = "list" if isinstance(culprit.value, list) else "mapping"
            message += f" (this {what} holds {len(culprit.value):,} items so far)"
        raise _RefusedError(YamlProblem(path, line, message), final=True)

    def _add(
        self, value: Any, size: int, height: int, line: int, *, merge_key: bool = False
    ) -> None:
        """A scalar or an alias: counted, then placed."""
        if len(self.stack) + height > MAX_DEPTH:
            raise self._refuse(
                line, f"nested deeper than {MAX_DEPTH} levels", self._here(), final=True
            )
        self._count(size, line)
        self._place(value, size, height, line, merge_key=merge_key)

    def _place(
        self,
        value: Any,
        size: int,
        height: int,
        line: int,
        *,
        merge_key: bool = False,
    ) -> None:
        if not self.stack:
            self.root = value
            return
        top = self.stack[-1]
        top.size += size
        top.height = max(top.height, height + 1)
        if isinstance(top.value, list):
            top.value.append(value)
            return
        if top.pending is _NO_KEY:
            self._key(top, value, line, merge_key=merge_key)
        elif top.pending is _MERGE_KEY:
            top.merges.extend(self._merge_sources(value, line))
            top.pending = _NO_KEY
        else:
            top.value[top.pending] = value
            top.pending = _NO_KEY

    def _key(self, top: _Frame, value: Any, line: int, *, merge_key: bool) -> None:
        if merge_key:
            name = "<<"
        elif isinstance(value, str):
            name = value
        elif isinstance(value, bool):
            name = "true" if value else "false"
        elif isinstance(value, int | float):
            name = repr(value)
        else:
            shown = "null" if value is None else _short(value)
            raise self._refuse(line, f"a key must be a string, not {shown}")
        if name in top.lines:
            raise self._refuse(line, f"duplicate key (first at line {top.lines[name]})", (name,))
        top.lines[name] = line
        top.pending = _MERGE_KEY if merge_key else name

    def _merge_sources(self, value: Any, line: int) -> list[dict[str, Any]]:
        sources = value if isinstance(value, list) else [value]
        if not all(isinstance(s, dict) for s in sources):
            raise self._refuse(line, "a merge key (<<) takes a mapping or a list of mappings")
        return sources


def _short(value: Any, limit: int = 40) -> str:
    """``value`` for a message, cut to ``limit`` characters."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
