"""What a run of ``bench.peers`` runs and what it yields: the systems, the workloads and their publish order, and
one run's result as the observer saw it (``analyse``)."""

from __future__ import annotations

from dataclasses import dataclass, field

SLOTS = 8  # 2 workers x 4


# -- systems ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class System:
    name: str
    label: str
    module: str  # bench.peers.sys_*
    venv: str  # "main" (.venv) or "peers" (.bench-venv)
    family: str  # celery | dramatiq | procrastinate | pgqueuer
    imports: str = ""  # what must import in its venv
    k1_only: bool = False  # cannot express K > 1
    slow: bool = False  # defaults that wait seconds between tries: W1 and W3, once, unless --all-workloads
    note: str = ""


SYSTEMS = [
    System("plain", "plain Celery (no keys)", "bench.peers.sys_celery", "main", "celery"),
    System("cookbook", "cookbook lock + retry(countdown=0.1), max_retries=None", "bench.peers.sys_celery", "main",
           "celery"),
    System("cookbook-default", "cookbook lock + retry(countdown=0.1), default max_retries (3)",
           "bench.peers.sys_celery", "main", "celery"),
    System("once", "celery-once (refuses while queued)", "bench.peers.sys_celery", "peers", "celery",
           imports="celery_once", k1_only=True),
    System("procrastinate", "procrastinate lock=, default polling (5 s)", "bench.peers.sys_procrastinate", "peers",
           "procrastinate", imports="procrastinate", k1_only=True, slow=True),
    System("procrastinate-0.1", "procrastinate lock=, fetch_job_polling_interval=0.1",
           "bench.peers.sys_procrastinate", "peers", "procrastinate", imports="procrastinate", k1_only=True),
    System("dramatiq", "Dramatiq ConcurrentRateLimiter, default backoff (15 s min)", "bench.peers.sys_dramatiq",
           "peers", "dramatiq", imports="dramatiq", slow=True),
    System("dramatiq-tuned", "Dramatiq ConcurrentRateLimiter, backoff 0.1-1 s", "bench.peers.sys_dramatiq",
           "peers", "dramatiq", imports="dramatiq"),
    System("pgqueuer", "PgQueuer, one entrypoint per key, concurrency_limit=K", "bench.peers.sys_pgqueuer",
           "peers", "pgqueuer", imports="pgqueuer"),
    System("keyed", "celery-keyed (README settings)", "bench.peers.sys_celery", "main", "celery"),
]
BY_NAME = {s.name: s for s in SYSTEMS}
#: The whole limit of a run of the slow defaults (Dramatiq's 15 s backoff, procrastinate's 5 s polling): enough to
#: show that they stall (W1 never finishes within a minute either), short enough to keep the full run under 20 min.
SLOW_TIMEOUT = 25.0


# -- workloads ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    keys: int
    per_key: int
    limit: int
    seconds: float

    @property
    def label(self) -> str:
        what = "trivial" if self.seconds == 0 else f"{self.seconds * 1000:.0f} ms"
        return f"{self.keys} key(s) x {self.per_key}, K = {self.limit}, {what}"

    @property
    def tasks(self) -> int:
        return self.keys * self.per_key

    @property
    def ideal(self) -> float:
        return max(self.per_key * self.seconds / self.limit, self.tasks * self.seconds / SLOTS)

    @property
    def throughput(self) -> bool:
        return self.seconds == 0

    @property
    def key_bound(self) -> bool:
        """The ideal is set by the busiest key (W1, W2): each of its gaps is a handoff. Where the 8 slots set it
        (W3-W5), a key's next task also waits for a slot, so its gaps are not the system's handoffs."""
        return self.seconds > 0 and self.per_key * self.seconds / self.limit >= self.tasks * self.seconds / SLOTS

    def scaled(self, scale: float, seconds: float | None) -> Workload:
        per_key = max(self.limit + 1, round(self.per_key * scale)) if scale != 1 else self.per_key
        keys = self.keys if self.name != "W6" or scale == 1 else max(10, round(self.keys * scale))
        sec = self.seconds if seconds is None or self.seconds == 0 else seconds
        return Workload(self.name, keys, per_key, self.limit, sec)


WORKLOADS = {
    "W1": Workload("W1", 5, 40, 1, 0.05),
    "W2": Workload("W2", 1, 200, 4, 0.05),
    "W3": Workload("W3", 50, 4, 1, 0.05),
    "W4": Workload("W4", 20, 50, 1, 0.05),
    "W5": Workload("W5", 20, 50, 2, 0.05),
    "W6": Workload("W6", 1000, 3, 1, 0.0),
}


#: The publish order: "round-robin" over the keys (as bench.gate), or "key-major" (each key's tasks in one burst,
#: key after key: a FIFO broker then hands the workers runs of one key). W6 is always round-robin (uncontended).
ORDER = ["round-robin"]


def task_list(wl: Workload, tag: str) -> list[tuple[str, str, float, int]]:
    """(key, task id, seconds, K) in publish order. The key's name is the workload's (``w2:...``)."""
    keys = [f"{wl.name.lower()}:{tag}-{i}" for i in range(wl.keys)]
    if ORDER[0] == "key-major" and not wl.throughput:
        return [(key, f"{tag}-{j}-{i}", wl.seconds, wl.limit) for i, key in enumerate(keys) for j in range(wl.per_key)]
    return [(key, f"{tag}-{j}-{i}", wl.seconds, wl.limit) for j in range(wl.per_key) for i, key in enumerate(keys)]


# -- results ------------------------------------------------------------------------------------------------------


@dataclass
class Result:
    system: str
    workload: str
    repeat: int
    tasks: int
    completed: int = 0
    duplicates: int = 0
    refused: int = 0
    failed: int = 0
    retries: int = 0
    messages: float = 0.0
    makespan: float = 0.0
    ratio: float = float("nan")  # makespan / ideal
    rate: float = 0.0  # tasks/s (W6)
    peak: int = 0  # the most tasks of one key running at once, as observed
    over_k: int = 0  # keys whose peak exceeded K
    handoffs: list[float] = field(default_factory=list)
    finished: bool = True
    waited: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)
    error: str = ""

    @property
    def lost(self) -> int:
        return max(0, self.tasks - self.completed - self.refused - self.failed) if self.finished else 0

    @property
    def unfinished(self) -> int:
        return 0 if self.finished else self.tasks - self.completed - self.refused - self.failed


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def analyse(res: Result, wl: Workload, rows: list[list[str]]) -> None:
    seen: set[str] = set()
    by_key: dict[str, list[tuple[float, float]]] = {}
    for start, end, key, task_id, _pid in rows:
        if task_id in seen:
            res.duplicates += 1
        seen.add(task_id)
        by_key.setdefault(key, []).append((float(start), float(end)))
    res.completed = len(seen)
    if not rows:
        return
    first = min(s for v in by_key.values() for s, _ in v)
    last = max(e for v in by_key.values() for _, e in v)
    res.makespan = last - first
    res.ratio = res.makespan / wl.ideal if wl.ideal > 0 else float("nan")
    res.rate = len(rows) / res.makespan if res.makespan > 0 else float("nan")
    for intervals in by_key.values():
        events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
        running = peak = 0
        for _, delta in events:
            running += delta
            peak = max(peak, running)
        res.peak = max(res.peak, peak)
        res.over_k += peak > wl.limit
        starts = sorted(s for s, _ in intervals)
        ends = sorted(e for _, e in intervals)
        for i in range(len(starts) - wl.limit):
            res.handoffs.append(max(0.0, starts[i + wl.limit] - ends[i]))
