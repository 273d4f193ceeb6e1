"""Fixtures shared by the wire tests."""

import pytest


@pytest.fixture(scope="module")
def tok():
    """The default model's tokenizer (SmolLM2), loaded once per module."""
    from replica.tokenizer import Tokenizer

    return Tokenizer.from_spec("default")
