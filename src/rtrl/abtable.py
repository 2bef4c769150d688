"""The canary's A/B table, one way everywhere: ``kubectl rtrl status``, the demo's console
and its HTML report turn a metric row into the same cells with :func:`cells`, and the two
text views lay them out with :func:`render_table`.

A row is either the analysis' own (``analysis.json``'s ``metrics[]``: snake_case, with
``kind`` and ``band``) or the Checkpoint's ``status.rollout[].metrics[]`` as the operator's
``judge()`` copies it (camelCase, unset fields left out). Both carry the relative change of
the canary vs the stable arm, its always-valid interval and the verdict; a row with none of
those (a status written before they existed) shows the absolute difference and interval
instead, marked ``(abs)``. A relative field that is null (no relative verdict possible, such
as a zero baseline) shows ``n/a``.

Numbers never use exponent notation: latencies and token counts (and anything of 100 or
more) with one decimal, rates with three, or with as many as two significant digits need
(a rare event's ``0.00042``). Percentages have one decimal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass
from typing import Any

NA = "n/a"
ABSOLUTE = "(abs)"
ABSOLUTE_NOTE = (
    f"{ABSOLUTE}: canary minus baseline; this status predates relative intervals and verdicts"
)
# The fields that tell a row of today (relative change, verdict) from an old status one.
RELATIVE_FIELDS = ("relative_difference", "relative_ci_low", "relative_ci_high", "verdict")

HEADERS = ("metric", "old", "new", "change", "always-valid CI", "verdict")
KUBECTL_HEADERS = ("METRIC", "BASELINE", "CANARY", "CHANGE", "CI (always-valid)", "VERDICT")
# per column: "<" left, ">" right
ALIGN = "<>>><<"


@dataclass(frozen=True)
class Cells:
    """One metric's display cells, in table order."""

    metric: str
    old: str
    new: str
    change: str
    interval: str
    verdict: str
    absolute: bool = False  # change and interval are the absolute difference (old status)

    def row(self) -> list[str]:
        return list(astuple(self)[:6])


def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(part.title() for part in rest)


def field(row: Mapping[str, Any], key: str) -> Any:
    """``key`` (snake_case) of a metric row in either form; None when absent or null."""
    if key in row:
        return row[key]
    return row.get(_camel(key))


def has_field(row: Mapping[str, Any], key: str) -> bool:
    return key in row or _camel(key) in row


def is_relative(row: Mapping[str, Any]) -> bool:
    """Whether the row is of today's form (relative change and verdict; any may be null),
    not an old status row with the absolute difference only."""
    return any(has_field(row, key) for key in RELATIVE_FIELDS)


def finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    out = float(value)
    return out if math.isfinite(out) else None


def decimals(name: str, value: float) -> int:
    """One decimal for latencies, token counts and anything of 100 or more; three for rates,
    or more where two significant digits need them (a rare event's 0.0012)."""
    if name.endswith("_ms") or "tokens" in name or abs(value) >= 100:
        return 1
    if value == 0:
        return 3
    return min(12, max(3, 1 - math.floor(math.log10(abs(value)))))


def number(value: Any, name: str = "", *, signed: bool = False) -> str:
    """A metric's value in fixed notation (``name`` picks the precision); ``n/a`` when
    missing or not finite."""
    x = finite(value)
    if x is None:
        return NA
    places = decimals(name, x)
    out = f"{x:{'+' if signed else ''}.{places}f}"
    if places > 3:  # the digits beyond three are there for significance only: 0.005, not 0.0050
        out = out[: len(out) - places + 3] + out[len(out) - places + 3 :].rstrip("0")
    if float(out) == 0:  # no "-0.000"
        out = out.replace("-", "+" if signed else "", 1)
    return out


def percent(value: Any) -> str:
    """A relative change: ``+2.3%``, one decimal, never an exponent; ``n/a`` when missing."""
    x = finite(value)
    if x is None:
        return NA
    out = f"{100 * x:+.1f}%"
    return "+0.0%" if out == "-0.0%" else out


def interval(low: str, high: str) -> str:
    return NA if NA in (low, high) else f"[{low}, {high}]"


def cells(row: Mapping[str, Any]) -> Cells:
    """The display cells of one metric row (analysis.json's snake_case or the status'
    camelCase)."""
    name = str(field(row, "name") or "?")
    old = number(field(row, "baseline"), name)
    new = number(field(row, "canary"), name)
    verdict = str(field(row, "verdict") or "-")
    if is_relative(row):
        low, high = percent(field(row, "relative_ci_low")), percent(field(row, "relative_ci_high"))
        change = percent(field(row, "relative_difference"))
        return Cells(name, old, new, change, interval(low, high), verdict)
    change = number(field(row, "difference"), name, signed=True)
    low = number(field(row, "ci_low"), name, signed=True)
    high = number(field(row, "ci_high"), name, signed=True)
    span = interval(low, high)
    return Cells(
        name,
        old,
        new,
        change if change == NA else f"{change} {ABSOLUTE}",
        span if span == NA else f"{span} {ABSOLUTE}",
        verdict,
        absolute=True,
    )


def band(row: Mapping[str, Any]) -> tuple[float | None, float | None] | None:
    """A guardrail row's band as (max relative drop, max relative rise); None without one."""
    value = row.get("band")
    if not isinstance(value, Mapping):
        return None
    drop = finite(value.get("maxRelativeDrop", value.get("max_relative_drop")))
    rise = finite(value.get("maxRelativeRise", value.get("max_relative_rise")))
    return None if drop is None and rise is None else (drop, rise)


def render_table(
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    align: str = "",
    indent: str = "",
    gap: int = 2,
) -> list[str]:
    """Fixed-width lines: each column as wide as its widest cell (header included), cells
    left- or right-aligned per ``align`` (default left), ``gap`` spaces apart."""
    table = [list(headers), *[list(r) for r in rows]]
    for r in table:
        if len(r) != len(headers):
            raise ValueError(f"row {r!r} has {len(r)} cells for {len(headers)} columns")
    widths = [max(len(r[i]) for r in table) for i in range(len(headers))]
    sides = align.ljust(len(headers), "<")
    out = []
    for r in table:
        padded = [
            c.rjust(w) if side == ">" else c.ljust(w)
            for c, w, side in zip(r, widths, sides, strict=True)
        ]
        out.append((indent + (" " * gap).join(padded)).rstrip())
    return out


def ab_table(
    rows: Iterable[Mapping[str, Any]], headers: Sequence[str] = HEADERS, indent: str = ""
) -> list[str]:
    """The A/B table of metric rows as text lines, with a note when a row is absolute."""
    shown = [cells(r) for r in rows]
    lines = render_table(headers, [c.row() for c in shown], ALIGN, indent)
    if any(c.absolute for c in shown):
        lines.append(f"{indent}{ABSOLUTE_NOTE}")
    return lines
