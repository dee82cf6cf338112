"""How the command line prints: plain tables, JSON for scripts, ages and times (UTC)."""

from __future__ import annotations

import decimal
import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import click


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, uuid.UUID | timedelta):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def print_json(document: Any) -> None:
    click.echo(json.dumps(document, default=_json_default, indent=2, sort_keys=True))


def done(as_json: bool, result: dict[str, Any], text: str) -> None:
    """Print a write's ``result`` as JSON, or its one line of ``text``."""
    if as_json:
        print_json(result)
    else:
        click.echo(text)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    return f"{int(seconds // 86400)}d{int(seconds % 86400 // 3600):02d}h"


def when(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = ()) -> str:
    """A plain text table (no borders), columns as wide as their widest cell; ``right``: right-aligned columns."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)
