"""setup.cfg configures tools that read it (flake8, pycodestyle, coverage.py), in step with pyproject.toml, and
carries no copy of the package's metadata (pyproject.toml is its only home)."""

from __future__ import annotations

import configparser
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_setup_cfg_configures_tools_and_copies_no_metadata() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not {"metadata", "options"} & set(cfg.sections())
    assert not any(s.startswith("options.") for s in cfg.sections())
    line_length = pyproject["tool"]["ruff"]["line-length"]
    assert cfg.getint("flake8", "max-line-length") == line_length
    assert cfg.getint("pycodestyle", "max-line-length") == line_length
    packages = {p.strip() for p in cfg.get("coverage:run", "source").split()}
    assert packages == {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
