"""The worker side of celery-keyed, as services in the manner of Celery's consumer steps: each owns its state and
its thread, has a ``*_once`` that tests call directly, and a ``start`` / ``stop`` safe to call twice. Each module
says at its top which thread owns which field; docs/worker.md draws them.

- ``intake``: whether a request is keyed, and its ``Arrival`` (headers, keys, D16 range checks; no thread);
- ``admission``: keyed requests admitted off the consumer loop, in batches (``admit_once``);
- ``releaser``: slots given back off the loop, in batches, and the releases kept while the ledger is down
  (``release_once``, ``flush_pending``);
- ``heartbeat``: lease renewal, a thread of the process (``heartbeat_once``, D7, D13);
- ``fence``: self-fencing by a timer that never waits on the ledger, and re-admission of a body it killed
  (``fence_once``, ``readmit_fenced``, D19);
- ``sweeper``: due-time sweep, reaper, gone predecessors, results of tasks that never ran (``sweep_once``, D2);
- ``handoff``: the dispatch policy of promotions (``route``) and the loop-calls pipe (``drain``, D4, D5);
- ``breaker``: the circuit breaker (``probe_once``, D9);
- ``revokes``: Celery's revoke commands stored in the ledger (``flush_pending``, D11).

The gate (``celery_keyed.gate.GateService``) composes them; ``celery_keyed.bootstep`` wires the gate into the
worker. The worker reaches the ledger only through ``celery_keyed.ledger.Ledger`` (tests/unit/test_worker_seams.py).
"""
