"""``install(app)`` puts the kombu Redis close guard in place (celery_keyed/compat.py) before any worker connects."""

from __future__ import annotations

from celery import Celery
from kombu.transport import redis as kombu_redis

import celery_keyed
from celery_keyed import compat


def test_install_guards_kombus_redis_channel_close() -> None:
    app = Celery("install-test", broker="memory://", set_as_current=False)
    celery_keyed.install(app)
    guarded = getattr(kombu_redis.Channel.__dict__["_connparams"], compat._MARK, False)
    assert guarded == compat.kombu_redis_close_affected()
