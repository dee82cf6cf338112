"""Kept for imports from before celery_keyed.testing (the throwaway servers live there now); also runs as
``python -m celery_keyed.testbed``, like ``python -m celery_keyed.testing``."""

from celery_keyed.testing import *  # noqa: F403
from celery_keyed.testing import __all__ as __all__
from celery_keyed.testing.__main__ import main
from celery_keyed.testing.postgres import PG_SUPERUSER  # noqa: F401
from celery_keyed.testing.servers import _as_user, _live  # noqa: F401
from celery_keyed.testing.servers import broker_from_env as _broker_from_env  # noqa: F401
from celery_keyed.testing.servers import die_with_parent as _die_with_parent  # noqa: F401
from celery_keyed.testing.servers import free_port as _free_port  # noqa: F401
from celery_keyed.testing.servers import launch_on_free_port as _launch_on_free_port  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
