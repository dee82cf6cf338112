"""The demo's chart says what happened: whole-number counts, a time axis on every panel, the arrivals that never ran
drawn where they were refused, a legend for the lanes, and each panel's time axis ending with its own data."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

# chart.py is loaded by its path: importing the example_project package would configure its Django project for the
# whole test process (its Celery app sets DJANGO_SETTINGS_MODULE), which tests that start pytest in a fresh
# directory inherit.
_spec = importlib.util.spec_from_file_location(
    "demo_chart", Path(__file__).resolve().parents[2] / "example_project" / "chart.py"
)
assert _spec is not None and _spec.loader is not None
chart = importlib.util.module_from_spec(_spec)
sys.modules["demo_chart"] = chart  # its dataclass looks its module up there
_spec.loader.exec_module(chart)
Run, draw_figure, write_chart = chart.Run, chart.draw_figure, chart.write_chart


def panels() -> dict[str, object]:
    return {
        "research": [Run("research:topic", 0.0, 2.0), Run("research:topic", 0.1, 2.1), Run("research:topic", 2.0, 4.0)],
        "research_limit": 2,
        "refused": [(0.05, "rejected"), (0.06, "rejected"), (3.0, "expired")],
        "api": {"tenant:a": [Run("tenant:a", 0.0, 1.0)], "tenant:b": [Run("tenant:b", 0.5, 1.5)]},
        "api_limit": 10,
        "tenant_limit": 3,
        "lanes": {"account:1": [Run("account:1", 0.0, 6.0)], "order:1": [Run("order:1", 0.0, 1.0, failed=True)]},
        "unit": 0.5,
    }


def test_the_chart_says_what_happened() -> None:
    import matplotlib.pyplot as plt

    fig = draw_figure(**panels())  # type: ignore[arg-type]
    try:
        first, second, third = fig.axes
        for ax in (first, second, third):
            assert ax.get_xlabel() == "seconds from the start of the phase"
        for ax in (first, second):  # in flight: whole numbers only
            ticks = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks)
        labels = first.get_legend_handles_labels()[1]
        assert "rejected on arrival (waiting room full)" in labels and "expired waiting (max wait)" in labels
        assert [t.get_text() for t in third.get_legend().get_texts()] == [
            "account: one at a time", "order: in order", "failed (retried)"
        ]
        assert second.get_xlim()[1] == pytest.approx(1.5 * 1.02)  # its own data, not the lanes' 6 s
        assert third.get_xlim()[1] == pytest.approx(6.0 * 1.02)
        assert first.get_xlim()[1] == pytest.approx(4.0 * 1.02)
        assert third.get_title(loc="left").startswith("3.")
    finally:
        plt.close(fig)


def test_write_chart_writes_a_png(tmp_path: Path) -> None:
    path = write_chart(tmp_path / "out" / "chart.png", **panels())
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
