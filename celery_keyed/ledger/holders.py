"""Holders: one row per worker process start (table ``keyed_holders``), D6.

A holder is ``hostname:pid:nonce``; the nonce differs on every start, so a restarted worker with the same
hostname and pid never renews its dead predecessor's claims. Leases are renewed per attempt (claims.py).
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger.clock import NOW

HOLDERS_UPSERT = sa.text(
    f"""
    INSERT INTO keyed_holders (holder, hostname, pid, started_at, seen_at)
    VALUES (:holder, :hostname, :pid, {NOW}, {NOW})
    ON CONFLICT (holder) DO UPDATE SET seen_at = excluded.seen_at
    """
)
HOLDERS_TOUCH = sa.text(f"UPDATE keyed_holders SET seen_at = {NOW} WHERE holder = :holder")


def new_holder(hostname: str | None = None, pid: int | None = None) -> str:
    """A fresh holder id for this process start."""
    return f"{hostname or socket.gethostname()}:{pid if pid is not None else os.getpid()}:{secrets.token_hex(4)}"


def holders_register(conn: sa.Connection, holder: str, *, now: Any = None) -> None:
    hostname, pid, _ = holder.rsplit(":", 2)
    conn.execute(HOLDERS_UPSERT, {"holder": holder, "hostname": hostname, "pid": int(pid), "now": now})
