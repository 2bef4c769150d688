"""The report's plots of quantities per cycle and over time: the A/B arms of each metric,
the staged data, the canary's weight, the learning curves and each checkpoint's answer mix.
Rates and counts start at 0; every plot has axes and units."""

from __future__ import annotations

from typing import Any

from matplotlib.ticker import MaxNLocator

from rtrl.abtable import number
from rtrl.core.api.checkpoint import CheckpointPhase
from rtrl.phasestyle import outcome, outcome_text

from .report_svg import colour, figure, hours_axis, percent_axis, plain_scalar, svg, when
from .traces import ACTIONS, TRAIN_TAGS

OLD = "#9e9e9e"  # the old arm: the checkpoint serving when the cycle began
# Series that are no phase take none of rtrl.phasestyle's colours (ColorBrewer Set2).
SERIES = ("#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#b3b3b3")
MONITORS = ("edit_rate", "clarification_rate", "invalid_tool_call_rate")


def decided(c: dict[str, Any]) -> str:
    """The phase a cycle's checkpoint was decided into (Promoted for a later Superseded)."""
    return outcome(c.get("phase"), c.get("decision"))[0]


def _value(c: dict[str, Any], name: str, arm: str) -> float | None:
    for m in c.get("metrics") or []:
        if m.get("name") == name and isinstance(m.get(arm), int | float):
            return float(m[arm])
    return None


def arms(cycles: list[dict[str, Any]], name: str, title: str, unit: str) -> str:
    """Both arms of one metric in each cycle's final look, as bars from 0: the old arm grey,
    the new one in the colour of what was decided; each bar labelled as the table writes it."""
    with figure(4.2, 2.6) as (fig, ax):
        labels = [f"cycle {c.get('cycle')}" for c in cycles]
        xs = range(len(cycles))
        for dx, arm, legend in (
            (-0.2, "baseline", "old (serving)"),
            (0.2, "canary", "new (canary), coloured by the decision"),
        ):
            values = [_value(c, name, arm) for c in cycles]
            colours = [OLD if arm == "baseline" else colour(decided(c)) for c in cycles]
            bars = ax.bar(
                [x + dx for x in xs],
                [v or 0.0 for v in values],
                width=0.38,
                color=colours,
                label=legend,
            )
            ax.bar_label(bars, [number(v, name) for v in values], fontsize=7, padding=2)
        ax.set_xticks(list(xs), labels)
        tallest = max([_value(c, name, a) or 0.0 for c in cycles for a in ("baseline", "canary")])
        ax.set_ylim(0, 1.2 * tallest or 1.0)
        ax.set_ylabel(unit)
        plain_scalar(ax.yaxis)
        ax.set_title(title, loc="left")
        fig.legend(loc="outside lower center", ncols=2, fontsize=7)
        return svg(fig, title)


def staged(cycles: list[dict[str, Any]]) -> str | None:
    """What the stage step measured on each cycle's data (the serving checkpoint's
    interactions): the behaviour monitors' rates from 0, and the mean reward."""
    staged = [(c.get("monitors") or {}) for c in cycles]
    if not any(staged):
        return None
    labels = [f"cycle {c.get('cycle')}" for c in cycles]
    with figure(8.6, 2.6, ncols=2) as (fig, (rates, reward)):
        for name, col in zip(MONITORS, SERIES, strict=False):
            ys = [((s.get("monitors") or {}).get(name)) for s in staged]
            rates.plot(
                labels,
                [y if isinstance(y, int | float) else None for y in ys],
                "-o",
                label=name,
                ms=4,
                color=col,
            )
        rates.set_ylim(0, None)
        percent_axis(rates.yaxis, signed=False)
        rates.set_ylabel("share of interactions")
        rates.legend(loc="best")
        rates.set_title("stage monitors of the staged data", loc="left")
        means = [((s.get("reward") or {}).get("mean")) for s in staged]
        bars = reward.bar(labels, [m or 0.0 for m in means], color=SERIES[2], width=0.5)
        reward.bar_label(bars, [number(m, "reward") for m in means], fontsize=7, padding=2)
        reward.axhline(0, color="#555", lw=0.8)
        reward.margins(y=0.2)
        plain_scalar(reward.yaxis)
        reward.set_ylabel("mean reward per interaction")
        reward.set_title("mean reward of the staged data", loc="left")
        return svg(fig, "the staged data: stage monitors and mean reward")


def weights(points: list[dict[str, Any]], cycles: list[dict[str, Any]]) -> str | None:
    """The canary's share of the users at every serving tick, as a step line from 0 to 100%,
    each canary period labelled with its checkpoint and coloured by what was decided."""
    ts = [(t, p) for p in points if (t := when(p.get("at"))) is not None]
    if not ts:
        return None
    phase_of = {c.get("checkpoint"): decided(c) for c in cycles}
    with figure(8.6, 2.4) as (fig, ax):
        xs = [t for t, _ in ts]
        ys = [float(p.get("weight") or 0) / 100 for _, p in ts]
        end_of_last = when(ts[-1][1].get("until"))
        if end_of_last is not None:  # the last tick lasts until its end too
            xs, ys = [*xs, end_of_last], [*ys, ys[-1]]
        ax.step(xs, ys, where="post", color="#555", lw=1.2)
        start = None
        for i, (t, p) in enumerate(ts):
            name = p.get("canary")
            if name and (start is None or ts[i - 1][1].get("canary") != name):
                start = i
            last = i + 1 == len(ts) or ts[i + 1][1].get("canary") != name
            if name and last and start is not None:
                end = ts[i + 1][0] if i + 1 < len(ts) else (when(p.get("until")) or t)
                col = colour(phase_of.get(name, CheckpointPhase.CANARY))
                ax.fill_between([ts[start][0], end], 0, ys[i], step="post", color=col, alpha=0.3)
                ax.annotate(
                    f"{name}: {phase_of.get(name, CheckpointPhase.CANARY)}",
                    (ts[start][0], ys[i]),
                    xytext=(2, 3),
                    textcoords="offset points",
                    fontsize=7,
                    color=col,
                )
        ax.set_ylim(0, 1.0)
        percent_axis(ax.yaxis, signed=False)
        ax.set_ylabel("canary share of users")
        hours_axis(ax)
        title = "canary weight over time"
        ax.set_title(title, loc="left")
        return svg(fig, title)


def curves(cycles: list[dict[str, Any]]) -> str | None:
    """The training scalars of every cycle's train step over its optimizer steps (from the
    TensorBoard events), one panel per scalar, one line per checkpoint. None when no cycle
    has any."""
    have = [c for c in cycles if c.get("training_curves")]
    if not have:
        return None
    with figure(8.6, 6.6, nrows=3, ncols=3) as (fig, grid):
        panels = list(grid.flat)
        styles = ("-", "--", ":", "-.")
        for i, tag in enumerate(TRAIN_TAGS):
            ax = panels[i]
            for k, c in enumerate(have):
                pts = (c.get("training_curves") or {}).get(tag) or []
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        styles[k % 4],
                        color=colour(decided(c)),
                        lw=1.2,
                        label=f"{c.get('checkpoint')}: {outcome_text(c.get('phase'), c.get('decision'))}",  # noqa: E501
                    )
            ax.set_title(tag.removeprefix("train/"), loc="left", fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # optimizer steps
            plain_scalar(ax.yaxis)
            if tag in (
                "train/clip_fraction",
                "train/truncation_fraction",
                "train/tokens_per_second",
            ):
                ax.set_ylim(0, None)
        legend = panels[-1]
        legend.axis("off")
        handles, labels = panels[0].get_legend_handles_labels()
        for ax in panels[1:-1]:  # a checkpoint with no reward but other tags
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        legend.legend(handles, labels, loc="center left", fontsize=7)
        title = "learning curves of each training run"
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
        return svg(fig, title)


ACTION_COLOURS = {
    "edit": "#8da0cb",
    "tool": "#66c2a5",
    "ask": "#e78ac3",
    "invalid_tool": "#fc8d62",
    "noise": "#b3b3b3",
}
ACTION_LABELS = {
    "edit": "edit",
    "tool": "valid tool call",
    "ask": "clarifying question",
    "invalid_tool": "invalid tool call",
    "noise": "noise",
}
KINDS = ("all", "edit", "tool", "tool_hard", "vague")


def answer_mix(mix: dict[str, dict[str, dict[str, Any]]], order: list[str]) -> str | None:
    """Per task kind, each checkpoint's answers as a stacked bar of shares: a reward hack
    shows directly (more questions, more invalid tool calls on the hidden-preference tasks)."""
    names = [n for n in order if n in mix] + [n for n in mix if n not in order]
    if not names:
        return None
    kinds = [k for k in KINDS if any(k in mix[n] for n in names)]
    # Each panel needs room for its title and its bars, and the figure for its title, axis
    # label and legend, however few checkpoints there are: a demo whose training failed has
    # one, and with less the layout collapsed (the title over the first panel's).
    height = 1.4 + len(kinds) * (0.5 + 0.26 * len(names))
    with figure(8.6, height, nrows=len(kinds), sharex=True, squeeze=False) as (fig, grid):
        axes = list(grid[:, 0])
        for ax, kind in zip(axes, kinds, strict=True):
            left = [0.0] * len(names)
            for action in ACTIONS:
                shares = [float((mix[n].get(kind) or {}).get(action) or 0.0) for n in names]
                ax.barh(
                    names,
                    shares,
                    left=left,
                    color=ACTION_COLOURS[action],
                    height=0.7,
                    label=ACTION_LABELS[action],
                )
                left = [a + b for a, b in zip(left, shares, strict=True)]
            ns = [int((mix[n].get(kind) or {}).get("n") or 0) for n in names]
            for y, n in enumerate(ns):
                ax.text(
                    1.01, y, f"n={n}", transform=ax.get_yaxis_transform(), va="center", fontsize=7
                )
            ax.set_xlim(0, 1)
            ax.invert_yaxis()
            ax.grid(axis="y", visible=False)
            ax.set_title(f"{kind} tasks" if kind != "all" else "all tasks", loc="left", fontsize=9)
        percent_axis(axes[-1].xaxis, signed=False)
        axes[-1].set_xlabel("share of the checkpoint's answers")
        title = "answer mix per checkpoint"
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=5, fontsize=7)
        return svg(fig, title)
