"""Holders: one row per worker process start (table ``keyed_holders``), D6.

A holder is ``hostname:pid:nonce``; the nonce differs on every start, so a restarted worker with the same
hostname and pid never renews its dead predecessor's claims. Leases are renewed per attempt (claims.py).
"""

from __future__ import annotations

import os
import secrets
import socket
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger.clock import NOW

HOLDERS_UPSERT = sa.text(
    f"""
    INSERT INTO keyed_holders (holder, hostname, pid, started_at, seen_at, machine, pids)
    VALUES (:holder, :hostname, :pid, {NOW}, {NOW}, :machine, CAST(:pids AS integer[]))
    ON CONFLICT (holder) DO UPDATE SET seen_at = excluded.seen_at, machine = excluded.machine,
                                      pids = excluded.pids
    """
)

# holders_set_pids: the heartbeat's record of the processes that may run this holder's bodies (its pool
# processes change when one is replaced); a successor reads them to know the holder is gone (item 8).
HOLDERS_SET_PIDS = sa.text(
    f"UPDATE keyed_holders SET pids = CAST(:pids AS integer[]), seen_at = {NOW} WHERE holder = :holder"
)

# holders_set_config_version: the keyed_config_version this holder started with (shown by status and the admin).
HOLDERS_SET_CONFIG_VERSION = sa.text("UPDATE keyed_holders SET config_version = :version WHERE holder = :holder")

# holders_latest: the most recent start of every hostname (a worker's restart is a new holder), with the version
# it runs and the claims it holds; what operators read as "the workers and their configuration versions".
HOLDERS_LATEST = sa.text(
    """
    SELECT DISTINCT ON (h.hostname) h.holder, h.hostname, h.pid, h.started_at, h.seen_at, h.config_version,
           (SELECT count(*) FROM keyed_claims c WHERE c.holder = h.holder) AS claims
      FROM keyed_holders h
     ORDER BY h.hostname, h.started_at DESC
    """
)

# holders_of_machine: the other holders whose pids live in this machine's process namespace and that still
# hold running claims: the only ones whose death this process can check.
HOLDERS_OF_MACHINE = sa.text(
    """
    SELECT h.holder, h.pids FROM keyed_holders h
     WHERE h.machine = :machine AND h.holder <> :holder AND h.pids IS NOT NULL
       AND EXISTS (SELECT 1 FROM keyed_claims c WHERE c.holder = h.holder AND c.state = 'running')
    """
)


def machine_identity() -> str | None:
    """The kernel boot and pid namespace of this process: holders with the same identity can see each other's
    pids. None where it cannot be told (no /proc): then no holder is ever judged dead by its pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return f"{boot}/{namespace}"


def pid_gone(pid: int) -> bool:
    """Whether no process runs with ``pid`` on this machine (a zombie counts as gone: it runs nothing). A pid
    reused by another process counts as alive: the caller then waits for the lease, which is safe."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def new_holder(hostname: str | None = None, pid: int | None = None) -> str:
    """A fresh holder id for this process start."""
    return f"{hostname or socket.gethostname()}:{pid if pid is not None else os.getpid()}:{secrets.token_hex(4)}"


def holders_register(
    conn: sa.Connection,
    holder: str,
    *,
    machine: str | None = None,
    pids: list[int] | None = None,
    now: datetime | None = None,
) -> None:
    hostname, pid, _ = holder.rsplit(":", 2)
    params = {"holder": holder, "hostname": hostname, "pid": int(pid), "machine": machine, "pids": pids, "now": now}
    conn.execute(HOLDERS_UPSERT, params)


def holders_set_pids(conn: sa.Connection, holder: str, pids: list[int], *, now: datetime | None = None) -> None:
    conn.execute(HOLDERS_SET_PIDS, {"holder": holder, "pids": pids, "now": now})


def holders_gone(conn: sa.Connection, holder: str, machine: str) -> list[str]:
    """Other holders of this machine that hold running claims and none of whose processes exist any more."""
    rows = conn.execute(HOLDERS_OF_MACHINE, {"machine": machine, "holder": holder}).all()
    return [r.holder for r in rows if r.pids and all(pid_gone(p) for p in r.pids)]


def holders_set_config_version(conn: sa.Connection, holder: str, version: int) -> None:
    conn.execute(HOLDERS_SET_CONFIG_VERSION, {"holder": holder, "version": version})


def holders_latest(conn: sa.Connection) -> list[sa.Row[Any]]:
    """The latest start of each hostname: holder, hostname, pid, started_at, seen_at, config_version, claims."""
    return list(conn.execute(HOLDERS_LATEST))
