"""Fixtures shared by the replica tests."""

import pytest


@pytest.fixture(scope="module")
def head_path(tmp_path_factory):
    """A random EAGLE-3 head for the tiny target of tests/replica/spec_engines.py, saved once per module."""
    from speculative.head import save_head
    from tests.speculative.util import random_head, tiny_target

    return str(save_head(random_head(tiny_target()), tmp_path_factory.mktemp("eagle3") / "tiny"))
