"""Optional packages the real-model and reference-format tests need."""

import importlib.util
import os

import pytest


def require(*packages):
    """Skips the calling test when a package is missing; fails it under CI, which installs every
    pinned package the README names (so a missing one there is a broken install, not a skip)."""
    for name in packages:
        if importlib.util.find_spec(name) is None:
            msg = f"{name} not installed (see the README and docs/models.md for the pinned install)"
            if os.environ.get("CI"):
                pytest.fail(msg)
            pytest.skip(msg)
