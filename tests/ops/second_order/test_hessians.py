"""Layer Hessians, kept by second_order (core's sequential walk takes its reducer from the caller)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

import surgery
from surgery.core.sequential import run_sequential
from surgery.ops.second_order.hessians import HessianReducer


def test_the_hessian_reduction_is_registered_once_surgery_is_imported():
    """``capture(reduce="hessian")`` works as before the module left core: importing any part of
    surgery runs its package, which registers the reduction."""
    code = "import surgery.core.capture as c; print('hessian' in c.REDUCTIONS.names())"
    env = {**os.environ, "PYTHONPATH": str(Path(surgery.__file__).resolve().parent.parent)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.strip() == "True"


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
