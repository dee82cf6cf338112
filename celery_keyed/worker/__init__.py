"""The worker side of celery-keyed, as services in the manner of Celery's consumer steps: each owns its state and
at most one thread, takes its collaborators explicitly (the ledger, its settings, the running table, the handoff, a
callback), has a ``*_once`` or a door that tests call directly, and a ``start`` / ``stop`` safe to call twice. None
imports the gate nor another service (.importlinter). Each module says at its top which thread owns which field;
docs/worker.md draws them.

The records they share (no service of their own):

- ``running``: ``Running`` (a claim held here), ``Lifecycle``, ``Prebound``, ``Job``, ``track``;
- ``poolline``: the pool semaphore's line and a keyed request's place in it;
- ``intake``: whether a request is keyed, and its ``Arrival`` (headers, keys, D16 range checks; no thread).

The keyed path, on the consumer loop and the admission threads:

- ``receipt``: park at receipt, claims ahead, ``park_waiting`` (``receive``);
- ``start``: the start when a pool process is ready (``execute``), the loop's part of a decided batch;
- ``decide``: what the admission and receipt threads decide for a batch;
- ``verdicts``: parked, dropped, or a final outcome without a run;
- ``finish``: the end of an attempt (``release``), the give-back of what never started;
- ``cancels``: newest wins (``check_cancels``);
- ``events``: Celery events, signals and the snapshot;
- ``prefetch``: the prefetch window (``fit_prefetch``).

The services with a thread or a timer:

- ``admission``: keyed requests admitted off the consumer loop, in batches (``admit_once``);
- ``releaser``: slots given back off the loop, in batches, and the releases kept while the ledger is down
  (``release_once``, ``flush_pending``);
- ``heartbeat``: lease renewal, a thread of the process (``heartbeat_once``, D7, D13);
- ``fence``: self-fencing by a timer that never waits on the ledger, and re-admission of a body it killed
  (``fence_once``, ``readmit_fenced``, D19);
- ``exits``: releases held until a pool process has exited (``watch_once``);
- ``sweeper``: due-time sweep, reaper, gone predecessors, results of tasks that never ran (``sweep_once``, D2);
- ``handoff``: the dispatch policy of promotions (``route``) and the loop-calls pipe (``drain``, D4, D5);
- ``breaker``: the circuit breaker (``probe_once``, D9);
- ``revokes``: Celery's revoke commands stored in the ledger (``flush_pending``, D11).

The gate (``celery_keyed.gate.GateService``) wires them and runs their lifecycle; ``celery_keyed.bootstep`` wires
the gate into the worker. The worker reaches the ledger only through ``celery_keyed.ledger.Ledger``
(tests/unit/test_worker_seams.py).
"""
