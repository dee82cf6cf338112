"""The reference of every metric celery-keyed exports, read from ``celery_keyed.metrics`` itself: name (as a query
names it: a counter with ``_total``), type, labels and help. ``docs/metrics.md`` lists exactly these (a test checks
it); ``python -m celery_keyed.metrics_reference`` prints the page's tables.

Two families: the **ledger gauges** a ``LedgerCollector`` reads from PostgreSQL on every scrape, and the **process
counters** moved by the code that sees the event. Needs the ``prometheus`` extra (``prometheus_client``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from celery_keyed import metrics


@dataclass(frozen=True)
class MetricDoc:
    """One exported metric: ``kind`` is ``gauge`` (ledger, per scrape) or ``process`` (counted by a process)."""

    name: str
    type: str
    labels: tuple[str, ...]
    help: str
    kind: str

    def row(self) -> str:
        """The metric's row in the docs page's table."""
        labels = ", ".join(f"`{label}`" for label in self.labels)
        return f"| `{self.name}` | {self.type} | {labels} | {self.help} |"


def _docs(families: Iterable[Any], labels: dict[str, tuple[str, ...]], kind: str) -> list[MetricDoc]:
    found = []
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "")  # prometheus_client appends _total
        found.append(MetricDoc(name, family.type, labels[family.name], family.documentation, kind))
    return found


def ledger_gauges() -> list[MetricDoc]:
    """The gauges a ``LedgerCollector`` reports (described without querying: no connection is opened)."""
    engine = sa.create_engine("postgresql+psycopg://")  # never connected: describe() reads no ledger
    try:
        families = list(metrics.LedgerCollector(engine).describe())
    finally:
        engine.dispose()
    # prometheus_client keeps a family's label names in ``_labelnames`` only (no public accessor)
    labels = {f.name: tuple(getattr(f, "_labelnames", ())) for f in families}
    return _docs(families, labels, "gauge")


def process_metrics() -> list[MetricDoc]:
    """The counters and the histogram of ``celery_keyed.metrics`` (every module-level collector of it)."""
    prometheus_client = metrics.prometheus_client
    collectors = [
        value
        for value in vars(metrics).values()
        if isinstance(value, prometheus_client.metrics.MetricWrapperBase)
    ]
    labels: dict[str, tuple[str, ...]] = {}
    families = []
    for collector in collectors:
        for family in collector.describe():
            labels[family.name] = tuple(collector._labelnames)  # no public accessor either
            families.append(family)
    return _docs(sorted(families, key=lambda f: f.name), labels, "process")


def reference() -> list[MetricDoc]:
    """Every metric celery-keyed exports: the ledger gauges, then the process metrics."""
    if not metrics.enabled():
        raise RuntimeError("the metrics reference needs prometheus_client: pip install 'celery-keyed[prometheus]'")
    return ledger_gauges() + process_metrics()


def table(docs: Iterable[MetricDoc]) -> str:
    """A Markdown table of ``docs`` (as ``docs/metrics.md`` has them)."""
    return "\n".join(["| metric | type | labels | meaning |", "|---|---|---|---|", *(d.row() for d in docs)])


def main() -> None:
    docs = reference()
    print("## Ledger gauges\n\n" + table(d for d in docs if d.kind == "gauge"))
    print("\n## Process counters\n\n" + table(d for d in docs if d.kind == "process"))


if __name__ == "__main__":
    main()
