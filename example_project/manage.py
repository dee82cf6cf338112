#!/usr/bin/env python
"""Django's command line for the example project: ``python -m example_project.manage migrate`` (from the
repository's root; ``python example_project/manage.py …`` works too)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
