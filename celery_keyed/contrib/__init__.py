"""Integrations with other tools: ``celery_keyed.contrib.pytest`` is the pytest plugin (docs/testing.md)."""
