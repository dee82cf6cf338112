"""docs/settings.md is the reference of every setting: each key of ``settings.DEFAULTS`` has its row there, with the
default the code uses, and the page names no setting the code does not read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from celery_keyed.settings import DEFAULTS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
ROW = re.compile(r"^\| `keyed_(\w+)` \| ([^|]*) \|", re.M)


def _rows() -> dict[str, str]:
    rows = ROW.findall(PAGE.read_text())
    names = [name for name, _ in rows]
    assert len(names) == len(set(names)), "a setting has two rows"
    return {name: default.strip() for name, default in rows}


def test_every_setting_has_its_row_and_no_row_names_a_setting_that_does_not_exist() -> None:
    rows = _rows()
    assert sorted(set(DEFAULTS) - set(rows)) == [], "settings the reference leaves out"
    assert sorted(set(rows) - set(DEFAULTS)) == [], "rows for settings the code does not read"


def test_each_row_gives_the_default_the_code_uses() -> None:
    for name, written in _rows().items():
        default = DEFAULTS[name]
        literal = re.match(r"^`([^`]*)`", written)
        if literal is None:  # computed or from the environment ("lease / 6", "env KEYED_DATABASE_URL")
            assert default is None, f"keyed_{name}: the page computes {written!r}, the code defaults to {default!r}"
            continue
        value = ast.literal_eval(literal.group(1))
        if isinstance(default, tuple | list):
            value, default = list(value), list(default)
        assert value == default and type(value) in (type(default), int, float), (
            f"keyed_{name}: the page says {written!r}, the code defaults to {DEFAULTS[name]!r}"
        )
