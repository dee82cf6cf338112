"""The one operation of this app's migrations: apply the core's ledger migrations to the Django database.

The core records every version it applied in ``keyed_migrations`` under an advisory lock (``celery_keyed.ledger
.migrations.migrate``), so a Django ``migrate`` and a worker (or ``celery keyed migrate``) never apply one twice.
Each core migration has a Django migration of the same number calling this; on a fresh database the first one
brings the ledger to the newest schema and the later ones find nothing to do.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations


def _apply(apps: Any, schema_editor: Any) -> None:
    from celery_keyed.ledger.migrations import migrate
    from celery_keyed_django.ledger import database_alias, engine_for

    if schema_editor.connection.alias != database_alias():
        return
    engine = engine_for(schema_editor.connection, pooled=False, statement_timeout=0)  # migrations: no timeout
    try:
        migrate(engine)
    finally:
        engine.dispose()


def apply_core_migrations() -> migrations.RunPython:
    """A migration operation applying every pending core migration (irreversible: the core owns the schema)."""
    return migrations.RunPython(_apply, elidable=False)
