"""Scale: what no other benchmark measures yet (DESIGN §8), side by side in one run: ``python -m bench.scale``.

    python -m bench.scale [--quick] [--only promotion,memory,shards] [--parked 1000000] [--small 100]

1. **Promotion latency, 1,000,000 parked attempts vs 100** (target ≤ 2x). Two databases on one durable server:
   one with ``--small`` parked attempts in all, one with ``--parked``. Both are filled by the same filler: bulk
   ``INSERT ... SELECT generate_series`` into the ledger's own tables, writing the rows ``Ledger.admit`` writes
   when it parks (a ``keyed_tasks`` row per task id, a ``keyed_waiting`` row with a number from
   ``keyed_arrival_seq``, a ``keyed_keys`` head row whose ``waiting`` counts them, a ``keyed_slots`` row per
   key); reconcile's counter check (``check_counters_once``) and ``Ledger.books()`` then confirm the books.
   The filler keys belong to a paused name (``fill``, limit 0), so they can never start; 1 in 10 of their rows
   is also not yet due (``not_before`` a day ahead). The parked rows are spread over many keys, and many stand
   behind one key. Measured keys (name ``meas``, K = 1, its slot held by a real claim of the benchmark):
   ``meas:0`` with 10 real parked attempts behind it in both databases, and in the large one also
   ``meas:deep`` with 10 % of the parked rows behind it (1 in 10 of them not yet due). A cycle: release the
   running claim (``Ledger.release(..., contended=True)``: the release and its promotion in one transaction,
   as the gate does for a key that parked recently), timed; then bind the promoted attempt (it is the next
   running claim) and admit one more arrival, which parks at the tail (the line keeps its length). The
   lines are cycled in turn, one cycle each, so they share the machine's noise. Then EXPLAIN (ANALYZE,
   BUFFERS) of the promotion's statements (and the sweep's) on the large database: which index they use.
2. **Worker memory, 100,000 parked attempts vs none** (target: flat). A real ``celery worker -P prefork``
   with the gate (bench.gate's app, variant B) on an empty ledger, then on one with ``--memory-parked``
   filler rows plus a few real parks (tasks published on a paused key: the worker parks them), alternating
   ``--memory-pairs`` times. RSS (psutil: the main process and its pool children) after the worker has swept
   for ``--sweep-seconds``.
3. **Hot gate, 8 shards vs 1 shard** (target ≥ 1.25x): bench.ledger's own measure (``Clients.run``, its 4
   client processes, K = 100, claim + release cycles), run ``--rounds`` times interleaved (ABBA), median and
   min-max of the per-round ratios, p99 claim latency.

A run holds ``flock $HOME/.celery-keyed-bench.lock`` (the command re-executes itself under ``flock``) and
records the load average before and after. Benchmarks are not tests: nothing here asserts a time.

The package: ``ledgers`` (the server, the databases and the filler that parks rows in bulk), ``promotion``,
``memory`` and ``shards`` (the three measures), ``__main__`` (the command).
"""
