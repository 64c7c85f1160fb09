"""QuantizeSpec and the keywords of quantize() that build it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

import surgery
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.ops.quantization.spec import QuantizeSpec


def test_the_signature_names_every_spec_field_and_the_docstring_every_keyword():
    parameters = inspect.signature(surgery.quantize).parameters
    fields = [f.name for f in dataclasses.fields(QuantizeSpec)]
    assert list(parameters) == ["model", *fields, "spec", "calibration", "work", "progress", "qparams"]
    named = {f.name for f in dataclasses.fields(QuantizeSpec)} - {"select", "exclude"}
    assert all(f"        {name}:" in surgery.quantize.__doc__ for name in named)
    assert "        select, exclude:" in surgery.quantize.__doc__


def test_an_unknown_keyword_is_one_line_naming_the_allowed_ones():
    model = nn.Linear(4, 2)
    before = model.weight.detach().clone()
    with pytest.raises(
        ConfigTypeError,
        match=r"^quantize='bitz': unknown keyword; allowed: weights, .*, originals, method, unrouted, spec, calibration, work, progress, qparams$",
    ):
        surgery.quantize(model, bitz=4)
    with pytest.raises(TypeError, match="unknown keyword"):  # with a spec too; a TypeError as Python's own
        surgery.quantize(model, QuantizeSpec(), bitz=4)
    assert torch.equal(model.weight, before)


def test_keywords_build_the_spec_and_a_spec_with_keywords_is_refused():
    model = nn.Linear(4, 2)
    with surgery.quantize(model, weights=surgery.GridSpec(bits=4), progress=False) as handle:
        assert handle.weights["weight"].spec.bits == 4
    with pytest.raises(
        ConfigError, match=r"^quantize.where=.input.: is given beside a QuantizeSpec: set it in the spec"
    ):
        surgery.quantize(model, QuantizeSpec(), where="input")
    with pytest.raises(ConfigError, match=r"^quantize.where=.output.: is given beside"):  # even a default:
        surgery.quantize(model, QuantizeSpec(where="input"), where="output")  # it would be ignored
