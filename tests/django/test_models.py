"""The core owns the schema, the Django app mirrors it: every ledger table has a model, every column a field of
the same type and nullability, the Django primary key is a column the ledger keeps unique; the app's migrations
are what ``makemigrations`` would write, and each core migration has its Django migration."""

from __future__ import annotations

import io
from importlib import import_module

import pytest
from django.apps import apps
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection
from django.db.migrations.loader import MigrationLoader

from celery_keyed.ledger.migrations import migration_files

pytestmark = pytest.mark.django_db

#: Columns Django uses as the primary key where the table's key spans several columns: each is drawn from a
#: sequence for every row, so it is unique although the table declares no constraint on it.
SEQUENCE_KEYS = {("keyed_claims", "fence"): "keyed_fence_seq", ("keyed_waiting", "arrival"): "keyed_arrival_seq"}

COLUMNS = """
    SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull
      FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE n.nspname = current_schema() AND c.relkind = 'r' AND c.relname LIKE 'keyed\\_%%'
       AND a.attnum > 0 AND NOT a.attisdropped
"""

UNIQUE_KEYS = """
    SELECT c.relname, array_agg(a.attname ORDER BY k.ord)
      FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
      CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
      JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum
     WHERE i.indisunique AND i.indpred IS NULL AND c.relname LIKE 'keyed\\_%%'
     GROUP BY c.relname, i.indexrelid
"""


def _tables() -> dict[str, dict[str, tuple[str, bool]]]:
    with connection.cursor() as cursor:
        cursor.execute(COLUMNS)
        rows = cursor.fetchall()
    tables: dict[str, dict[str, tuple[str, bool]]] = {}
    for table, column, type_, notnull in rows:
        tables.setdefault(table, {})[column] = (type_, not notnull)
    return tables


def _models() -> dict[str, type]:
    models = apps.get_app_config("celery_keyed_django").get_models()
    return {m._meta.db_table: m for m in models if not m._meta.proxy}  # a proxy (an admin page's view) has no table


def test_every_ledger_table_has_an_unmanaged_model() -> None:
    models = _models()
    assert sorted(models) == sorted(_tables())
    assert all(not m._meta.managed for m in models.values())


def test_models_mirror_columns_types_and_nullability() -> None:
    tables = _tables()
    problems = []
    for table, model in _models().items():
        fields = {f.column: f for f in model._meta.concrete_fields if f.column}
        columns = tables[table]
        for column in sorted(set(columns) - set(fields)):
            problems.append(f"{table}.{column}: column has no field")
        for column in sorted(set(fields) - set(columns)):
            problems.append(f"{table}.{column}: field has no column")
        for column in sorted(set(fields) & set(columns)):
            field = fields[column]
            type_, nullable = columns[column]
            if field.db_type(connection) != type_:
                problems.append(f"{table}.{column}: field type {field.db_type(connection)}, column type {type_}")
            if field.null != nullable:
                problems.append(f"{table}.{column}: field null={field.null}, column nullable={nullable}")
    assert problems == []


def test_django_primary_keys_are_unique_in_the_ledger() -> None:
    with connection.cursor() as cursor:
        cursor.execute(UNIQUE_KEYS)
        unique = {(table, tuple(columns)) for table, columns in cursor.fetchall()}
    for table, model in _models().items():
        pk = model._meta.pk
        columns = tuple(f.column for f in getattr(pk, "fields", [pk]))
        if (table, columns) in unique:
            continue
        assert len(columns) == 1 and (table, columns[0]) in SEQUENCE_KEYS, f"{table}: Django pk {columns} not unique"
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d JOIN pg_attribute a"
                " ON a.attrelid = d.adrelid AND a.attnum = d.adnum WHERE d.adrelid = %s::regclass AND a.attname = %s",
                [table, columns[0]],
            )
            # No default: the ledger's statements fill it, each with nextval of the sequence (grep-able below).
            assert cursor.fetchone() is None
        sequence = SEQUENCE_KEYS[(table, columns[0])]
        from celery_keyed.ledger import claims, waiting

        sources = (claims.CLAIMS_INSERT_RUNNING.text, claims.CLAIMS_INSERT_PROMOTED.text, waiting.WAITING_INSERT.text)
        assert any(f"nextval('{sequence}')" in s for s in sources)


def test_makemigrations_check_is_clean() -> None:
    out = io.StringIO()
    call_command("makemigrations", "celery_keyed_django", "--check", "--dry-run", stdout=out, stderr=out)


def test_each_core_migration_has_its_django_migration() -> None:
    loader = MigrationLoader(connection, ignore_no_migrations=True)
    django_names = sorted(name for app, name in loader.disk_migrations if app == "celery_keyed_django")
    core = [version for version, _ in migration_files()]
    assert django_names == core
    for name in django_names:
        module = import_module(f"celery_keyed_django.migrations.{name}")
        ops = module.Migration.operations
        assert ops[0].code.__name__ == "_apply", f"{name} must first apply the core's migrations"


def test_core_and_django_agree_on_applied_versions() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT version FROM keyed_migrations ORDER BY version")
        applied = [r[0] for r in cursor.fetchall()]
    assert applied == [version for version, _ in migration_files()]
    loader = MigrationLoader(connection)
    assert {n for a, n in loader.applied_migrations if a == "celery_keyed_django"} == set(applied)


def test_router_keeps_the_app_on_the_ledger_database(settings: object) -> None:
    from celery_keyed_django.models import Key
    from celery_keyed_django.routers import LedgerRouter

    router = LedgerRouter()
    assert router.db_for_read(Key) == "default"
    settings.CELERY_KEYED_DJANGO_DATABASE = "ledger"  # type: ignore[attr-defined]
    assert router.db_for_read(Key) == router.db_for_write(Key) == "ledger"
    assert router.allow_migrate("ledger", "celery_keyed_django") is True
    assert router.allow_migrate("default", "celery_keyed_django") is False
    assert router.allow_migrate("default", "auth") is None
    assert router.db_for_read(User) is None



def test_the_outcome_choices_are_the_cores_table_of_outcome_kinds() -> None:
    from celery_keyed.ledger import OUTCOME_KINDS

    expected = [(kind.outcome.value, kind.label) for kind in OUTCOME_KINDS]
    assert list(apps.get_model("celery_keyed_django", "TaskRecord")._meta.get_field("outcome").choices) == expected
    assert list(apps.get_model("celery_keyed_django", "PrunedTasks")._meta.get_field("outcome").choices) == expected
