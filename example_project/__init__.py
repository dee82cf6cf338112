"""Example project for celery-keyed: a small Django + Celery project (settings, celery, shop/tasks) showing
the three patterns, and the demo that runs it (``python -m example_project.demo``, ``make demo``)."""
