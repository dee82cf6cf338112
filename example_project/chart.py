"""The demo's PNG: tasks in flight per key over time, drawn from what the tasks recorded themselves.

matplotlib (the ``demo`` extra) with its Agg backend: no display, no browser. Three panels:

1. the eight-arrival fixture: ``research:topic`` in flight against its limit of 2, with the arrivals that never ran
   (rejected on arrival, expired waiting) marked when they were refused;
2. the partner API gate: calls in flight in all against 10, and per tenant against 3;
3. one lane per mutex key (``account:*``) and per ordered group (``order:*``): a bar while a task runs, red for
   an attempt that failed (and was retried).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Run:
    """One attempt as observed: its key, start and end in seconds from its phase's start, and whether it failed."""

    key: str
    start: float
    end: float
    failed: bool = False


def in_flight_steps(runs: Sequence[Run]) -> tuple[list[float], list[int]]:
    """The in-flight count of ``runs`` as a step function: (times, count from each time on)."""
    events = sorted([(r.start, 1) for r in runs] + [(r.end, -1) for r in runs], key=lambda e: (e[0], e[1]))
    times, counts, current = [0.0], [0], 0
    for at, delta in events:
        current += delta
        times.append(at)
        counts.append(current)
    return times, counts


def draw_figure(
    *,
    research: Sequence[Run],
    research_limit: int,
    api: Mapping[str, Sequence[Run]],
    api_limit: int,
    tenant_limit: int,
    lanes: Mapping[str, Sequence[Run]],
    unit: float,
    refused: Sequence[tuple[float, str]] = (),
) -> Any:
    """The three panels as a matplotlib Figure (Agg backend). ``refused``: (seconds, outcome) of each research
    arrival that never ran ("rejected" or "expired"), drawn in panel 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    fig, (ax1, ax2, ax3) = plt.subplots(
        3, 1, figsize=(11, 10), gridspec_kw={"height_ratios": [1, 1.3, 1.3]}, constrained_layout=True
    )
    fig.suptitle(f"celery-keyed demo: tasks in flight per key (1 unit = {unit:g}s)", fontsize=13)

    times, counts = in_flight_steps(research)
    ax1.step(times, counts, where="post", color="tab:blue", linewidth=2, label="research:topic")
    ax1.axhline(research_limit, color="tab:blue", linestyle="--", linewidth=1, label=f"limit {research_limit}")
    ax1.set_title("1. eight arrivals on one gate: 2 run, 3 wait (one past its deadline), 3 rejected", loc="left")
    for outcome, marker, color, label in (
        ("rejected", "x", "tab:red", "rejected on arrival (waiting room full)"),
        ("expired", "v", "tab:purple", "expired waiting (max wait)"),
    ):
        at = [t for t, kind in refused if kind == outcome]
        if at:
            ax1.scatter(at, [research_limit + 0.5] * len(at), marker=marker, color=color, s=60, label=label, zorder=3)
    ax1.set_ylim(0, research_limit + 1)
    ax1.set_ylabel("in flight")
    research_last = max([r.end for r in research] + [t for t, _ in refused], default=1.0)
    ax1.set_xlim(0, research_last * 1.02)
    ax1.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)

    every_call = [r for runs in api.values() for r in runs]
    times, counts = in_flight_steps(every_call)
    ax2.step(times, counts, where="post", color="black", linewidth=2.2, label="api (all tenants)")
    ax2.axhline(api_limit, color="black", linestyle="--", linewidth=1, label=f"api limit {api_limit}")
    ax2.axhline(tenant_limit, color="grey", linestyle=":", linewidth=1, label=f"tenant limit {tenant_limit}")
    for tenant, runs in sorted(api.items()):
        times, counts = in_flight_steps(runs)
        ax2.step(times, counts, where="post", linewidth=1, alpha=0.8, label=tenant)
    ax2.set_title("2. partner API: one gate of 10 shared by every tenant, at most 3 per tenant", loc="left")
    ax2.set_ylim(0, api_limit + 2)
    ax2.set_ylabel("in flight")
    ax2.set_xlim(0, max((r.end for r in every_call), default=1.0) * 1.02)
    ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)

    names = sorted(lanes, key=lambda k: (k.split(":")[0], k))
    for row, key in enumerate(names):
        for run in lanes[key]:
            ax3.broken_barh(
                [(run.start, max(run.end - run.start, 0.01))],
                (row - 0.35, 0.7),
                facecolors="tab:red" if run.failed else ("tab:green" if key.startswith("order:") else "tab:orange"),
                edgecolors="white",
                linewidth=0.8,
            )
    ax3.set_yticks(range(len(names)), names)
    ax3.invert_yaxis()
    ax3.set_title(
        "3. same run as 2: mutex per account (1 at a time each); events of each order in order", loc="left"
    )
    ax3.legend(
        handles=[
            Patch(facecolor="tab:orange", label="account: one at a time"),
            Patch(facecolor="tab:green", label="order: in order"),
            Patch(facecolor="tab:red", label="failed (retried)"),
        ],
        loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
    )
    ax3.set_xlim(0, max((r.end for runs in lanes.values() for r in runs), default=1.0) * 1.02)
    for ax in (ax1, ax2):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # tasks in flight are whole numbers
    for ax in (ax1, ax2, ax3):
        ax.set_xlabel("seconds from the start of the phase")
        ax.grid(axis="x", alpha=0.3)
    return fig


def write_chart(path: Path, **panels: Any) -> Path:
    """Draw the three panels (``draw_figure``'s arguments) into ``path``, a PNG; its folder is created."""
    fig = draw_figure(**panels)  # selects the Agg backend first
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
