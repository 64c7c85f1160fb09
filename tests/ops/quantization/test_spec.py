"""QuantizeSpec and the keywords of quantize() that build it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

import surgery
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.ops.quantization.spec import QuantizeKeywords, QuantizeSpec


def test_the_keywords_typed_dict_names_the_spec_fields_one_for_one():
    assert list(QuantizeKeywords.__annotations__) == [f.name for f in dataclasses.fields(QuantizeSpec)]
    assert QuantizeKeywords.__total__ is False


def test_the_signature_is_short_and_the_docstring_names_every_keyword():
    parameters = inspect.signature(surgery.quantize).parameters
    assert list(parameters) == ["model", "spec", "calibration", "qparams", "progress", "work", "keywords"]
    named = {f.name for f in dataclasses.fields(QuantizeSpec)} - {"select", "exclude"}
    assert all(f"        {name}:" in surgery.quantize.__doc__ for name in named)
    assert "        select, exclude:" in surgery.quantize.__doc__


def test_an_unknown_keyword_is_one_line_naming_the_allowed_ones():
    model = nn.Linear(4, 2)
    before = model.weight.detach().clone()
    with pytest.raises(
        ConfigTypeError,
        match=r"^quantize='bitz': unknown keyword; allowed: weights, .*, originals, calibration, qparams, progress, work$",
    ):
        surgery.quantize(model, bitz=4)
    with pytest.raises(TypeError, match="unknown keyword"):  # with a spec too; a TypeError as Python's own
        surgery.quantize(model, QuantizeSpec(), bitz=4)
    assert torch.equal(model.weight, before)


def test_keywords_build_the_spec_and_a_spec_with_keywords_is_refused():
    model = nn.Linear(4, 2)
    with surgery.quantize(model, weights=surgery.GridSpec(bits=4), progress=False) as handle:
        assert handle.weights["weight"].spec.bits == 4
    with pytest.raises(ConfigError, match="is a QuantizeSpec: set where in it, not also as keywords"):
        surgery.quantize(model, QuantizeSpec(), where="input")
    with surgery.quantize(model, QuantizeSpec(), where="output", progress=False):  # a default: nothing ignored
        pass
