"""The metrics reference (``celery_keyed.metrics_reference``) against what is really exported, and the docs page
``docs/metrics.md`` against the reference: the page lists exactly the metrics a worker exports, with their type,
labels and help."""

from __future__ import annotations

import re
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, groups_register
from celery_keyed.metrics import LedgerCollector
from celery_keyed.metrics_reference import MetricDoc, reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_the_docs_page_lists_exactly_the_reference() -> None:
    rows = [line for line in DOC.read_text(encoding="utf-8").splitlines() if line.startswith("| `celery_keyed_")]
    assert rows == [doc.row() for doc in reference()], "regenerate with: python -m celery_keyed.metrics_reference"


def test_the_reference_is_every_metric_a_scrape_exports(database_url: str, ledger: Ledger) -> None:
    """A real scrape: the ledger collector on a ledger with a fair name (so every gauge family has samples) and the
    process collectors of the default registry; every family named celery_keyed_* is in the reference, with its
    type and labels, and nothing else is."""
    ledger.configure({"api": NameConfig("api", limit=1, fair=True), "order": NameConfig("order", group_failure="hold")})
    ledger.admit(Arrival("a", key="api:1", fair_key="t1"))
    # a held group (its head failed under group_failure 'hold'), for celery_keyed_groups_held
    ledger.transaction(lambda conn: groups_register(conn, "order:1", "h", now=None))
    head = ledger.admit(Arrival("h", group_key="order:1", group_seq=1))
    assert head.fence is not None
    ledger.release(Token("h", 0), head.fence, Outcome.FAILED, detail="held for the scrape")
    assert ledger.group_hold("order:1") is not None
    registry = CollectorRegistry()
    collector = LedgerCollector(database_url, timeout=5.0)
    registry.register(collector)
    try:
        exposition = generate_latest(registry).decode() + generate_latest(prometheus_client.REGISTRY).decode()
    finally:
        collector.engine.dispose()
    scraped: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(exposition):
        if not family.name.startswith("celery_keyed_"):
            continue
        if family.name.endswith("_created"):  # prometheus_client's creation time of a counter or histogram
            assert {family.name.removesuffix("_created"), family.name.replace("_created", "_total")} & set(
                doc.name for doc in reference() if doc.type in ("counter", "histogram")
            ), family.name
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {label for sample in family.samples for label in sample.labels if label != "le"}
        scraped[name] = (family.type, labels)
    documented = {doc.name: doc for doc in reference()}
    assert set(scraped) == set(documented)
    for name, (kind, labels) in scraped.items():
        assert kind == documented[name].type, name
        assert labels <= set(documented[name].labels), name  # a counter with no sample yet shows no labels
    gauges = [doc for doc in documented.values() if doc.kind == "gauge"]
    assert all(scraped[doc.name][1] == set(doc.labels) for doc in gauges)  # every gauge had samples here


@pytest.mark.parametrize("doc", reference(), ids=lambda doc: doc.name)
def test_every_metric_has_words_for_an_operator(doc: MetricDoc) -> None:
    assert doc.help.strip() and not re.search(r"\bissue \d+|\bD\d\d\b", doc.help), doc.help
