"""The example of docs/testing.md, run as a user's test suite would run it (a pytest subprocess in a fresh
directory, the plugin loaded from its entry point): one sync per account, accounts in parallel, in an
in-process worker and in two prefork workers; a gate of 2 when the test's settings say so."""

from __future__ import annotations

import pytest
from docs_example import example_files, write_example

pytest_plugins = ["pytester"]


def test_the_guide_has_the_example() -> None:
    files = example_files()
    assert {"proj/celery.py", "proj/tasks.py", "tests/test_sync_account.py"} <= set(files)
    assert 'keyed_timeline.peak("account:1") == 1' in files["tests/test_sync_account.py"]


def test_the_example_passes(pytester: pytest.Pytester) -> None:
    tests = write_example(pytester.path)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", *tests, timeout=240)
    result.assert_outcomes(passed=3)
    for name in (
        "test_one_sync_per_account_accounts_in_parallel",
        "test_two_syncs_of_one_account_at_most",
        "test_sync_in_two_prefork_workers",
    ):
        result.stdout.fnmatch_lines([f"*::{name} PASSED*"])
    assert result.ret == 0, result.stdout.str() + result.stderr.str()  # nothing raised at exit either
