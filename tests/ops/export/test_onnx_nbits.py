"""4-bit Linear weights in ONNX Runtime's MatMulNBits: surgery's integers, scales and zero points
in the op's blocks, run by ONNX Runtime with the simulation's outputs (within float summation),
and what the op cannot hold refused in one line, nothing written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery import GridSpec
from surgery.core.errors import ConfigError

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 64), nn.GELU(), nn.Linear(64, 10, bias=False)).eval()


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128])  # 64 and 128 leave the 96 inputs a shorter last block
@pytest.mark.parametrize("shape", [(4, 96), (2, 5, 96)])  # traced as Gemm (with its bias), and as MatMul
def test_matmul_nbits_runs_the_simulation_s_weights(tmp_path, symmetric, group, shape):
    model, x = mlp(), torch.randn(*shape)
    spec = GridSpec(bits=4, group_size=group, symmetric=symmetric)
    with surgery.quantize(model, weights=spec, method="gptq", calibration=[x]) as handle:
        record = surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=[x])
    # ONNX Runtime dequantizes (q - zero point) x scale in float32 and sums in its own order:
    # measured max |diff| 2e-7 on outputs of magnitude ~1; 1e-5 still fails one wrong integer
    assert record.parity.max_abs < 1e-5 and record.int8_ops == (2, 2)
    ops = [node.op_type for node in onnx.load(str(record.path)).graph.node]
    assert ops.count("MatMulNBits") == 2 and "MatMul" not in ops and "Gemm" not in ops


def test_a_wrong_integer_would_show(tmp_path):
    # one weight moved one step of its grid after the export: the file and the model part by far more than 1e-5
    model, x = mlp(), torch.randn(4, 96)
    with surgery.quantize(model, weights=GridSpec(bits=4, group_size=32)) as handle:
        record = surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=[x])
        with torch.no_grad():
            model[0].weight[0, 0] += handle.weights["0.weight"].scale[0, 0]
            shifted = (model(x) - record.run(record.load(), x)[0]).abs().max()
    assert shifted > 1e-4  # measured 6e-4: fifty times the bound


@pytest.mark.parametrize(
    ("weights", "activations", "message"),
    [
        (
            GridSpec(bits=4, per_channel=True),
            None,
            r"^quantize\.weights='0\.weight: 4-bit affine': .* MatMulNBits 4-bit",
        ),
        (GridSpec(bits=3, group_size=32), None, r"^quantize\.weights='0\.weight: 3-bit affine group 32'"),
        (GridSpec(bits=4, group_size=48), None, r"group 48'"),
        (GridSpec(bits=4, group_size=32), GridSpec(bits=8), r"^quantize\.activations='0': its 4-bit weights run in"),
    ],
)
def test_what_matmul_nbits_cannot_hold_is_refused_in_one_line(tmp_path, weights, activations, message):
    model, x = mlp(), torch.randn(4, 96)
    with surgery.quantize(model, weights=weights, activations=activations, calibration=[x]) as handle:
        with pytest.raises(ConfigError, match=message):
            surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=[x])
    assert list(tmp_path.iterdir()) == []
