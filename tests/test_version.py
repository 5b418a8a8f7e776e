"""The version is written once and every place that reports it agrees. No engine, no clock."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import omni_trio

ROOT = Path(__file__).resolve().parent.parent


def test_installed_metadata_reads_the_package_version() -> None:
    """pyproject.toml takes the version from omni_trio._version (omni_trio.__version__),
    not a copy of it."""
    assert importlib.metadata.version("omni_trio") == omni_trio.__version__
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^version\s*=\s*"', pyproject, re.M) is None
    assert 'version = { attr = "omni_trio._version.__version__" }' in pyproject
    assert omni_trio._version.__version__ is omni_trio.__version__


def test_changelog_has_the_current_version() -> None:
    """CHANGELOG.md keeps an Unreleased section and a section for the current version."""
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "## [Unreleased]" in changelog
    assert f"## [{omni_trio.__version__}] - " in changelog
