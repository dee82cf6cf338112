"""Configuring names: store the application's configuration of every name (``names.names_upsert``, guarded by the
configuration version) and promote the waiters a raised limit lets in (``promote.promote_name``), in one
transaction. Above ``names`` and ``promote`` (promote reads names: the transaction that writes them and promotes
after lives here, so neither imports the other's caller).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from celery_keyed.ledger.attempts import Promotion
from celery_keyed.ledger.caps import cap_key
from celery_keyed.ledger.names import NameConfig, names_newest_version, names_upsert
from celery_keyed.ledger.promote import DEFAULT_DISPATCH_TIMEOUT, promote_name


@dataclass
class Configured:
    """What ``configure_names`` did: the names written, the names kept because a newer configuration stored them
    (``kept``), the newest version the ledger holds afterwards, and the promotions a raised limit made."""

    written: list[str]
    kept: list[str]
    newest_version: int
    promotions: list[Promotion]


def configure_names(
    conn: sa.Connection,
    configs: Mapping[str, NameConfig],
    *,
    version: int = 0,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> Configured:
    """Store every config as ``version`` (a worker does this at start; a name stored by a newer version is kept)
    and promote waiters a raised limit lets in (D2)."""
    written: list[str] = []
    kept: list[str] = []
    for name in sorted(configs):
        (written if names_upsert(conn, configs[name], version=version, now=now) else kept).append(name)
    promotions: list[Promotion] = []
    for name in written:
        promotions += promote_name(conn, name, dispatch=dispatch, now=now)
        promotions += promote_name(conn, cap_key(name), dispatch=dispatch, now=now)  # a raised or lifted cap
    return Configured(written, kept, names_newest_version(conn), promotions)
