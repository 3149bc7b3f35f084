"""The knob registry: one entry per HAPConfig field, checks naming the knob, per-model defaults, CLI flags."""

import argparse
import math
from dataclasses import fields

import pytest

from hap import KNOBS, HAPConfig, knob
from hap.__main__ import parser
from hap.knobs import SEED, Knob


def test_every_config_field_is_a_knob_in_order_with_its_default():
    assert [f.name for f in fields(HAPConfig)] == [k.name for k in (*KNOBS, SEED)]
    for f in fields(HAPConfig):
        assert f.default == knob(f.name).default, f.name


def test_every_knob_is_a_flag_of_the_cli():
    run = parser()._subparsers._group_actions[0].choices["run"]
    flags = {opt for action in run._actions for opt in action.option_strings}
    assert {k.flag for k in KNOBS} <= flags
    assert knob("first_layers").flag == "--first-layers"


@pytest.mark.parametrize(
    "name, value, expected",
    [("groups", 2.0, 2), ("decay", 1, 1.0), ("temperature", math.inf, math.inf), ("retain", None, None),
     ("first_layers", None, None), ("rows", "last", "last")],
)
def test_check_returns_the_typed_value(name, value, expected):
    out = knob(name).check(value)
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize(
    "name, value, match",
    [("groups", 1.5, r"groups=1.5 must be an integer >= 1"), ("groups", None, r"groups=None"),
     ("decay", 0.0, r"decay=0.0 must be a number in \(0, 1\]"), ("tau_sink", 1.01, r"tau_sink=1.01 .* \[0, 1\]"),
     ("temperature", -1, r"temperature=-1 must be a number > 0"), ("sink_rho", math.nan, r"sink_rho=nan"),
     ("rows", "all", r"rows='all' is not allowed; choose one of prompt, last"), ("seed", True, r"seed=True")],
)
def test_check_refuses_naming_the_knob_and_what_is_allowed(name, value, match):
    with pytest.raises(ValueError, match=match):
        knob(name).check(value)


@pytest.mark.parametrize(
    "name, text, expected",
    [("retain", " 0.1", 0.1), ("retain", "none", None), ("first_layers", "2", 2), ("first_layers", "", None),
     ("groups", "2.5", 2.5), ("temperature", "inf", math.inf), ("method", " fastv ", "fastv"), ("decay", "x", "x")],
)
def test_parse_text(name, text, expected):
    assert knob(name).parse(text) == expected


def test_per_model_rules():
    assert [knob("first_layers").resolve(n) for n in (6, 15, 16, 32)] == [0, 0, 2, 2]
    assert [knob("retain").resolve(n) for n in (6, 32)] == [0.25, 0.111]
    assert knob("groups").resolve(6) == knob("groups").default == 3
    assert [k.name for k in KNOBS if k.rule is not None] == ["retain", "first_layers"]


def test_every_default_passes_its_own_check_and_the_rules_too():
    for k in KNOBS:
        assert k.check(k.default) == k.default
        for n in (6, 32):
            assert k.check(k.resolve(n)) == k.resolve(n)


def test_add_to_a_parser_leaves_unset_flags_none():
    p = argparse.ArgumentParser()
    knob("decay").add_to(p)
    Knob("n", int, 1, "a count", low=0).add_to(p, default=5)
    assert vars(p.parse_args([])) == {"decay": None, "n": 5}
    assert vars(p.parse_args(["--decay", "0.25", "--n", "3"])) == {"decay": 0.25, "n": 3}


def test_unknown_knob():
    with pytest.raises(KeyError, match="no knob 'speed'"):
        knob("speed")
