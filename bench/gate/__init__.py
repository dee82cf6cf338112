"""The Celery gate with real prefork workers, side by side with plain Celery in one run (DESIGN §8).

    python -m bench.gate [--quick] [--tasks 2000] [--pairs 5] [--keyed-pairs 3] [--control] [--loop-admission]
                         [--without-ledger] [--loop-releases]

Starts its own durable PostgreSQL (fsync on) and a Redis broker (``celery_keyed.testing``) unless
``KEYED_DATABASE_URL`` / ``CELERY_BROKER_URL`` name servers; creates and migrates a database of its own. Every
worker is a real ``celery worker -P prefork`` subprocess of the app in ``bench/gate/worker_app.py``
(``-A bench.gate.worker_app``), either plain Celery (variant A) or the same tasks with ``celery_keyed.install(app)``
and a configured gate (variant B). Each run gets a queue of its own. The observer is independent of Celery and of
the ledger: every task RPUSHes its own start and end times (``time.time()``, taken in the pool process) to a Redis
list; the result backend is disabled.

a. Unkeyed tasks, worker with celery-keyed installed (B) vs without (A): pairs of a c=2 worker of A and one of B,
   A first in one pair and B first in the next (a drain that follows another runs slower on this machine), each
   draining N trivial tasks published to its queue before it starts. Throughput = N / (last end - first start).
   Median ratio B/A and its spread (target ≥ 0.97). ``--control`` also runs the same pairs as A and A again: the
   ratio's noise floor on this machine.
b. Keyed tasks on 1,000 distinct uncontended keys (``concurrency_key="k:{i}"``) vs the same task as plain
   Celery on the same broker, the same way (target ≥ 0.8). The keys' ledger rows are created before (warm keys).
   ``--loop-admission`` also runs b with admission on the consumer loop (``keyed_admission_batch = 0``, the path
   before the admission thread): what the thread buys, in the same run. ``--without-ledger`` also runs b with every
   claim and release answered in the worker itself, no database call (``answer_without_ledger``: the bound is NOT
   kept, a measurement only): what the worker's own code costs a keyed task, the most a faster ledger could give;
   then again with those answers given on the consumer loop itself, no thread between (``keyed-free-loop``:
   admission at a pool process's start, releases in the outcome hook): what the hand-overs to the worker's threads
   cost on top. ``--loop-releases`` also runs b with the uncontended releases made from the consumer loop without
   blocking it, instead of by the releaser's thread (b-loop), and with the claims taken ahead made the same way too
   (b-loop2) (``bench/gate/loop_releases.py``: a measurement of that design for gate b only, not a feature),
   taking turns with plain Celery and with b in the same rounds.
c. Handoff on one contended key, K = 1: two c=2 workers already running, a burst of small tasks (5 ms) of one
   key. Handoff = start of a task - end of the task before it on that key (the end is taken just before the task
   returns; the slot is released after that, in the worker's main process). p50 / p99 (target ≤ 5 / ≤ 25 ms),
   also over only the handoffs after the ledger had recorded every arrival (nothing left to park), and broker
   messages published per completed task (Redis ``INFO commandstats`` LPUSH calls, the initial
   publish included; target ≤ 2, ≤ 1 with local handoff).
d. The contended workload of DESIGN §8: 5 keys x 40 tasks of 50 ms, K = 1, two c=4 workers (8 pool slots)
   already running; ideal makespan 2.0 s. Makespan = last end - first start (target ≤ 1.10 x ideal).

The package: ``worker_app`` (the app the workers run and its variants), ``harness`` (the servers, the worker
processes, the drains and bursts it times, the rounds), ``report`` (its tables), ``__main__`` (the command) and
``loop_releases`` (the ledger's calls made from the consumer loop: a measurement).
"""
