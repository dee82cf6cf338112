"""The plugin with pytest-celery installed (issue 10): pytest-celery 1.x replaces Celery's ``celery_app`` /
``celery_worker`` fixtures with Docker ones, which cannot run here. The celery-keyed plugin must not depend on
them: a throwaway virtualenv gets celery-keyed (editable, from this tree) and pytest-celery, and runs the
example of docs/testing.md there, with both plugins loaded. Skipped, saying why, when pip cannot install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from docs_example import ROOT, write_example

PRESENT = """
import pytest_celery


def test_pytest_celery_is_loaded_and_owns_celery_worker(request):
    plugin = request.config.pluginmanager.get_plugin("celery")
    assert plugin is not None and plugin.__name__ == "pytest_celery.plugin"
    assert int(pytest_celery.__version__.split(".")[0]) >= 1
    keyed = request.config.pluginmanager.get_plugin("celery_keyed")
    assert keyed is not None and keyed.__name__ == "celery_keyed.contrib.pytest"
    from pytest_celery.fixtures import worker

    assert hasattr(worker, "celery_worker")  # the Docker worker fixture, which the keyed fixtures do not use
"""


def _run(
    command: list[str], timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def pytest_celery_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("pytest-celery-venv")
    created = _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    if created.returncode != 0:
        pytest.skip(f"cannot create a virtualenv: {created.stderr[-1000:]}")
    python = venv / "bin" / "python"
    installed = _run(
        [str(python), "-m", "pip", "install", "-q", "-e", f"{ROOT}[redis,embedded]", "pytest-celery>=1"],
        timeout=600,
    )
    if installed.returncode != 0:
        errors = "\n".join(line for line in installed.stderr.splitlines() if "is ignored" not in line)
        pytest.skip(f"pip cannot install celery-keyed and pytest-celery in a fresh virtualenv:\n{errors[-2000:]}")
    return python


def test_the_example_passes_with_pytest_celery_installed(pytest_celery_venv: Path, tmp_path: Path) -> None:
    tests = write_example(tmp_path)
    (tmp_path / "tests" / "test_pytest_celery_present.py").write_text(PRESENT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    result = _run(
        [str(pytest_celery_venv), "-m", "pytest", "-p", "no:cacheprovider", "-v", *tests,
         "tests/test_pytest_celery_present.py"],
        timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    for name in (
        "test_one_sync_per_account_accounts_in_parallel",
        "test_two_syncs_of_one_account_at_most",
        "test_sync_in_two_prefork_workers",
        "test_pytest_celery_is_loaded_and_owns_celery_worker",
    ):
        assert f"::{name} PASSED" in output, output[-6000:]
    assert "4 passed" in output, output[-3000:]
