"""Benchmarks (not tests): ``python -m bench.ledger``. Each prints ratios measured side by side in one run."""
