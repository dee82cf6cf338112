"""Example project for celery-keyed: the demo app (``demo_app``) and its runner (``python -m example_project.demo``)."""
