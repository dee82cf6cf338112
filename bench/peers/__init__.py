"""celery-keyed side by side with what Celery users use today (issue 11): ``python -m bench.peers``.

See ``bench/peers/harness.py`` for what it runs and measures. Each peer's worker is this benchmark's own code
(``sys_celery``, ``sys_dramatiq``, ``sys_procrastinate``, ``sys_pgqueuer``); the peers are installed into
``.bench-venv/`` from ``bench/requirements-peers.txt``, never into the project's ``.venv``.
"""
