"""Kept for imports from before celery_keyed.testing: the standby lives in ``celery_keyed.testing.replica``."""

from celery_keyed.testing.replica import *  # noqa: F403
from celery_keyed.testing.replica import __all__ as __all__
