"""`python -m replica`'s flags as the engine gets them."""

import pytest

from replica.__main__ import engine_config, parse_args


def test_activation_flags_reach_the_engine_config():
    cfg = engine_config(parse_args(["--decode-activations", "int8", "--prefill-activations", "int16"]))
    assert (cfg.decode_activations, cfg.prefill_activations) == ("int8", "int16")
    default = engine_config(parse_args([]))
    assert (default.decode_activations, default.prefill_activations) == ("int16", "auto")
    with pytest.raises(SystemExit):
        parse_args(["--decode-activations", "auto"])
