"""docs/cli.md is the reference of ``celery keyed``: every subcommand has a row in its table, and that row names
each of the subcommand's options (``--json``, common to all, is described once above the table)."""

from __future__ import annotations

import re
from pathlib import Path

from celery_keyed.cli import keyed

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_every_subcommand_and_option_is_in_the_reference() -> None:
    page = PAGE.read_text()
    assert "`--json`" in page
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    missing: list[str] = []
    for name, command in sorted(keyed.commands.items()):
        # a row names the subcommand at its start, or after a "/" when it shares the row with its opposite
        own = [row.split(" | ")[0] for row in rows if re.search(r"(^\| |/ )`" + re.escape(name) + r"[ `]", row)]
        if not own:
            missing.append(name)
            continue
        for param in command.params:
            for option in param.opts:
                if option.startswith("--") and option != "--json" and not any(option in row for row in own):
                    missing.append(f"{name} {option}")
    assert missing == [], f"docs/cli.md leaves out: {missing}"
