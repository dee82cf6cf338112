"""celery-keyed's Django app: add ``"celery_keyed_django"`` to ``INSTALLED_APPS``.

The core (``celery_keyed.ledger``) owns the schema; this app's migrations only apply the core's migrations to
the Django database, its models mirror the ledger's tables with ``managed = False``, and its admin writes only
through the ledger's own functions (overrides, fenced release, revoke). See docs/django.md.
"""
