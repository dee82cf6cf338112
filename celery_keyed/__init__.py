"""celery-keyed: keyed concurrency for Celery, backed by a Postgres slot ledger."""

__version__ = "0.1.0.dev0"
