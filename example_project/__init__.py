"""Example project for celery-keyed: a small Django + Celery project (settings, celery, shop/tasks) showing
the three patterns, and the demo that runs it (``python -m example_project.demo``, ``make demo``).

The project's Celery app is imported here, as Celery's Django recipe does: a script or a view that imports only
``example_project.shop.tasks`` then publishes through this app (its broker, its gate), not through Celery's default
app (which would send to amqp://localhost, where no worker listens)."""

from example_project.celery import app as celery_app

__all__ = ("celery_app",)
