"""The `podman` marker: tests that build the images and play the manifests with podman
(tests/deploy/test_podman.py, minutes). Like `gpu`, left out of a plain `pytest` / `make test`;
`-m podman` (or any -m naming it) runs them, and they skip, saying why, where podman cannot."""

from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "podman: builds the images and plays the manifests with podman (-m podman)")


def pytest_collection_modifyitems(config, items):
    if "podman" in (config.getoption("markexpr") or ""):
        return
    left = [i for i in items if i.get_closest_marker("podman")]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [i for i in items if not i.get_closest_marker("podman")]
