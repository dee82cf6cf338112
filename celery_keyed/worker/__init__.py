"""The worker side of celery-keyed, as services in the manner of Celery's consumer steps: each owns its state and
its thread, has a ``*_once`` that tests call directly, and a ``start`` / ``stop`` safe to call twice.

- ``admission``: keyed requests admitted off the consumer loop, in batches.

The gate (``celery_keyed.gate.GateService``) composes them; ``celery_keyed.bootstep`` wires the gate into the
worker.
"""
