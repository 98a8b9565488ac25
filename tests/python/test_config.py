"""ductile.load_config given a Config already loaded: returned as it is, or
refused with a ConfigError when ``format`` asks for the other kind (a TOML
Config has no DeepSpeed JSON text for the readers of a DeepSpeed config)."""

import pytest

import ductile
from ductile.elasticity import deepspeed_config_plan


def test_a_loaded_config_is_returned_when_its_format_fits():
    toml = ductile.load_config("\n")  # a TOML text with no sections: no plugin needed
    assert ductile.load_config(toml) is toml
    assert ductile.load_config(toml, format="toml") is toml
    deepspeed = ductile.load_config({"train_batch_size": 8})
    assert deepspeed.format == "deepspeed"
    assert ductile.load_config(deepspeed, format="deepspeed") is deepspeed


def test_a_loaded_config_of_the_other_format_is_a_config_error():
    toml = ductile.load_config("\n")
    expected = (r"config: <string> is a loaded toml config, but format='deepspeed' was asked "
                r"for; valid: a deepspeed config \(path, text, dict or a ductile.Config of "
                r"format 'deepspeed'\)")
    with pytest.raises(ductile.ConfigError, match=expected):
        ductile.load_config(toml, format="deepspeed")
    # A reader of DeepSpeed configs got the TOML Config's missing JSON text
    # (None) before, and failed with a TypeError of the binding.
    with pytest.raises(ductile.ConfigError, match=expected):
        deepspeed_config_plan(toml)
    deepspeed = ductile.load_config({"train_batch_size": 8})
    with pytest.raises(ductile.ConfigError,
                       match=r"config: <dict> is a loaded deepspeed config, but format='toml'"):
        ductile.load_config(deepspeed, format="toml")
