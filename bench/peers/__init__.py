"""celery-keyed side by side with what Celery users use today, in one run (DESIGN §8): ``python -m bench.peers``.

    python -m bench.peers [--quick] [--repeats 3] [--systems a,b] [--workloads W1,W2] [--write-docs]

Same machine, same PostgreSQL (durable, fsync on) and Redis (``celery_keyed.testing``, or ``KEYED_DATABASE_URL``
/ ``CELERY_BROKER_URL``), one run. Every system gets 8 execution slots (2 workers x 4), prefetch 1, acks_late
where it applies; its workers are real processes running this benchmark's own code (``bench/peers/sys_*.py``).
The peers run from their own virtualenv, ``.bench-venv/`` (``bench/requirements-peers.txt``, installed on first
use); a peer that cannot be installed or imported gets a "not installed" row.

Workloads (50 ms tasks unless said; published round-robin over the keys, or key by key with --order key-major;
the workers already running):
W1 5 keys x 40, K = 1 · W2 one gate K = 4 x 200 · W3 50 keys x 4, K = 1 · W4 20 keys x 50, K = 1 ·
W5 20 keys x 50, K = 2 · W6 1,000 distinct uncontended keys x 3,000 trivial tasks (throughput).

Measures per system x workload (median of the repeats, with min-max; the systems are interleaved across repeats):
makespan / ideal (ideal = max(per-key work / K, all work / 8); makespan = last end - first start, as the task
bodies recorded them), the peak per key seen by the observer (the task bodies RPUSH their own start and end to
Redis: never a system's own books), handoff p50 / p99 (the i-th end of a key -> its (i+K)-th start; shown where
the busiest key sets the ideal, W1 and W2: elsewhere a key's next task also waits for a free slot), broker
messages per task (Celery: Redis LPUSH calls, the publish included; Dramatiq: every enqueue; procrastinate and
PgQueuer: job rows inserted), refusals and retries per task, tasks failed and lost, and W6's throughput.

A run holds ``flock $HOME/.celery-keyed-bench.lock`` (the command re-executes itself under ``flock``) and
records the load average before and after. Benchmarks are not tests: nothing here asserts a time.

The package: ``plan`` (the systems, the workloads, what one run yields), ``harness`` (the servers, the peers'
virtualenv, the worker and publisher processes, one run timed), ``report`` (the table, docs/benchmarks.md's section)
and ``__main__`` (the command). Each peer's worker is this benchmark's own code (``sys_celery``, ``sys_dramatiq``,
``sys_procrastinate``, ``sys_pgqueuer``); the peers are installed into ``.bench-venv/`` from
``bench/requirements-peers.txt``, never into the project's ``.venv``.
"""
