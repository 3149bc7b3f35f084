"""HAPConfig validation: every bad value names the field and the allowed range."""

import math

import pytest

from hap import METHODS, HAPConfig


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"method": "fastest"}, r"method='fastest'.*" + ", ".join(METHODS)),
        ({"retain": 0.0}, r"retain=0.0 must be a number in \(0, 1\]"),
        ({"retain": 1.5}, r"retain=1.5"),
        ({"retain": math.nan}, r"retain=nan"),
        ({"retain": "0.1"}, r"retain='0.1'"),
        ({"flops_ratio": -0.2}, r"flops_ratio=-0.2"),
        ({"retain": 0.1, "flops_ratio": 0.2}, r"either retain or flops_ratio"),
        ({"first_layers": -1}, r"first_layers=-1 must be an integer >= 0"),
        ({"first_layers": 1.5}, r"first_layers=1.5"),
        ({"groups": 0}, r"groups=0 must be an integer >= 1"),
        ({"decay": 0}, r"decay=0"),
        ({"decay": 1.2}, r"decay=1.2"),
        ({"temperature": 0}, r"temperature=0 must be a number > 0"),
        ({"temperature": math.nan}, r"temperature=nan"),
        ({"tau_sink": 2}, r"tau_sink=2"),
        ({"tau_disp": -0.1}, r"tau_disp=-0.1"),
        ({"sink_rho": 0.5}, r"sink_rho=0.5"),
        ({"rows": "all"}, r"rows='all'"),
        ({"seed": -3}, r"seed=-3"),
        ({"groups": True}, r"groups=True"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HAPConfig(**kwargs)


def test_defaults_and_derived_budget():
    cfg = HAPConfig()
    assert (cfg.method, cfg.first_layers, cfg.groups, cfg.decay, cfg.seed) == ("hap", None, 3, 0.5, 0)
    deep, shallow = cfg.resolved(32), cfg.resolved(6)
    assert (deep.first_layers, deep.retain) == (2, 0.111)  # FastV's K and the 64-of-576 budget on deep decoders
    assert (shallow.first_layers, shallow.retain) == (0, 0.25)  # cut before layer 0 on shallow ones
    assert HAPConfig(flops_ratio=0.3).resolved(32).retain is None
    assert HAPConfig(first_layers=1, retain=0.3).resolved(6) == HAPConfig(first_layers=1, retain=0.3)
    assert HAPConfig(temperature=math.inf).temperature == math.inf
