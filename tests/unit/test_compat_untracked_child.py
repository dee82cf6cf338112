"""``patch_celery_untracked_child`` (celery_keyed/compat.py): Celery's prefork pool registered with the event loop
again (a broker reconnect) while a pool process whose exit it already handled is still in its list. On a real
``AsynPool`` with real child processes: Celery's own method raises the worker's fatal ``ValueError``, the patched
one leaves that process to ``maintain_pool`` and tracks the others."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery.concurrency.asynpool import AsynPool
from kombu.asynchronous import Hub

from celery_keyed.compat import patch_celery_untracked_child


@pytest.fixture
def pool_and_hub() -> Iterator[tuple[AsynPool, Hub]]:
    pool = AsynPool(processes=2, threads=False)
    hub = Hub()
    try:
        yield pool, hub
    finally:
        pool.terminate()
        hub.close()


def _untracked(pool: AsynPool) -> tuple[object, object]:
    """What ``_event_process_exit`` leaves on a process whose exit code could not be read yet: untracked, still
    in the pool's list until the next ``maintain_pool``."""
    exited, alive = pool._pool[0], pool._pool[1]
    exited._sentinel_poll = None
    return exited, alive


def test_celerys_own_method_kills_the_consumer_start(pool_and_hub: tuple[AsynPool, Hub]) -> None:
    pool, hub = pool_and_hub
    patch_celery_untracked_child()
    original = AsynPool._track_child_process.celery_original  # type: ignore[attr-defined]
    _untracked(pool)
    # The worker's "Unrecoverable error": kombu 5.7's hub says "file descriptor is None", 5.5 and 5.6 fail on
    # ``None.fileno()``.
    with pytest.raises((ValueError, AttributeError), match=r"file descriptor is None|no attribute 'fileno'"):
        for proc in pool._pool:
            original(pool, proc, hub)


def test_the_patched_pool_registers_again_and_tracks_the_live_processes(
    pool_and_hub: tuple[AsynPool, Hub],
) -> None:
    pool, hub = pool_and_hub
    assert patch_celery_untracked_child()
    assert patch_celery_untracked_child()  # idempotent
    exited, alive = _untracked(pool)
    pool.register_with_event_loop(hub)  # the consumer's start after a broker reconnect: no exception
    assert exited._sentinel_poll is None  # type: ignore[attr-defined]  # left to maintain_pool
    sentinel = alive._sentinel_poll  # type: ignore[attr-defined]
    assert isinstance(sentinel, int) and sentinel in hub.readers  # the live process's exit is still watched
