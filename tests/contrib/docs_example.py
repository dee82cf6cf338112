"""The example of docs/testing.md as files: every ```python block whose first line is ``# path`` (the
project ``proj`` and its tests), so that the tests run exactly what the guide shows."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "testing.md"

#: The pytest configuration of the example: ``proj`` imported from the project's root, and warnings as errors
#: (the plugin must emit none) except Celery's Redis backend's call of redis-py's deprecated ``setex``.
PYTEST_INI = """[pytest]
pythonpath = .
filterwarnings =
    error
    ignore:Call to deprecated setex:DeprecationWarning
"""


def example_files() -> dict[str, str]:
    """``{relative path: source}`` of the guide's example."""
    blocks = re.findall(r"```python\n# ([\w/.]+\.py)\n(.*?)```", GUIDE.read_text(), flags=re.S)
    files = {path: source for path, source in blocks}
    files.setdefault("proj/__init__.py", "")
    return files


def write_example(directory: Path) -> list[str]:
    """Write the example project and its pytest.ini into ``directory``; return the test files."""
    for path, source in example_files().items():
        target = directory / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source)
    (directory / "pytest.ini").write_text(PYTEST_INI)
    return sorted(p for p in example_files() if p.startswith("tests/"))
