"""Layer Hessians, kept by second_order (core's sequential walk takes its reducer from the caller)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import surgery
from surgery.core.sequential import run_sequential
from surgery.ops.second_order.hessians import HessianReducer


def test_the_reduction_is_two_xtx_over_rows():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(5, 3)
    with surgery.capture(model, select="0", what="inputs", reduce="hessian") as seen:
        model(x)
    found = seen.inputs["0"]
    assert found["rows"] == 5
    torch.testing.assert_close(found["hessian"][0], 2 * x.T @ x / 5)


def test_the_sequential_walk_takes_its_reducer_from_the_caller():
    reduce = inspect.signature(run_sequential).parameters["reduce"]
    assert reduce.default is inspect.Parameter.empty and reduce.kind is inspect.Parameter.KEYWORD_ONLY
    assert callable(HessianReducer)


def test_a_hessian_is_summed_over_calls_and_read_once_without_a_second_copy():
    """Several calls sum (in place) to the same ``2 XᵀX / rows``; reading the result twice gives
    the same tensor (the running sum became it), and a call after the read is refused in one
    line rather than summed into a result already handed out."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    xs = [torch.randn(3, 4) for _ in range(3)]
    with surgery.capture(model, select="0", what="inputs", reduce="hessian") as seen:
        for x in xs:
            model(x)
    x = torch.cat(xs)
    first = seen.inputs["0"]
    assert first["rows"] == 9
    torch.testing.assert_close(first["hessian"][0], 2 * x.T @ x / 9)
    assert seen.inputs["0"]["hessian"] is first["hessian"]
    reducer = HessianReducer("0", model[0])
    reducer.update(torch.randn(2, 4))
    reducer.result()
    try:
        reducer.update(torch.randn(2, 4))
    except RuntimeError as err:
        assert "read while the model still ran" in str(err)
    else:
        raise AssertionError("an update after the result was summed silently")


def test_a_nan_anywhere_in_the_hessian_is_refused_once_per_layer():
    """The finite check looks at the smallest and largest entries: a NaN, +Inf or -Inf anywhere fails it."""
    for bad in (float("nan"), float("inf"), -float("inf")):
        reducer = HessianReducer("layer", nn.Linear(3, 2))
        x = torch.randn(4, 3)
        x[1, 2] = bad
        reducer.update(x)
        try:
            reducer.result()
        except surgery.ConfigError as err:
            assert "NaN or Inf reached this layer" in str(err)
        else:
            raise AssertionError(f"{bad} in the inputs gave a Hessian")


def test_gptaq_statistics_refuse_a_nan_in_either_stream_once_per_layer():
    """GPTAQ's sums are checked once, after the batches: a NaN or Inf in the compressed stream's
    inputs or in the float stream's (which only the asymmetry sees) fails it."""
    from surgery.ops.second_order.hessians import asymmetric_hessians

    layer = nn.Linear(3, 2)
    clean = [torch.randn(4, 3) for _ in range(2)]
    found = asymmetric_hessians("layer", layer, [c + 0.1 for c in clean], clean)
    assert torch.isfinite(found["hessian"]).all() and found["rows"] == 8
    for stream in ("floats", "inputs"):
        for bad in (float("nan"), float("inf")):
            spoiled = [c.clone() for c in clean]
            spoiled[1][2, 1] = bad
            floats, inputs = (spoiled, clean) if stream == "floats" else ([c + 0.1 for c in clean], spoiled)
            with pytest.raises(surgery.ConfigError, match="NaN or Inf reached this layer"):
                asymmetric_hessians("layer", layer, floats, inputs)
