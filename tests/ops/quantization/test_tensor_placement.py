"""``quantize(..., where="tensors")``: each activation tensor quantized once, by the module that
writes it, as ONNX Runtime's QDQ fusion quantizes (target="onnx")."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

import surgery
from surgery.core.errors import CheckpointError, ConfigError

A8 = surgery.GridSpec(bits=8)


def small_resnet() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=10).eval()


def batches(count: int = 3, size: int = 32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3, size, size, generator=generator) for _ in range(count)]


def test_a_resnet_is_quantized_once_per_tensor():
    model = small_resnet()
    with surgery.quantize(model, weights=None, activations=A8, target="onnx", calibration=batches()) as handle:
        keys = set(handle.activations)
        qparams = handle.qparams()
    # the shared ReLU of each block runs twice: after conv1 and after the residual addition
    assert {"layer1.0.relu@output", "layer1.0.relu@output#1", "relu@output"} <= keys
    assert qparams["layer1.0.relu@output.scale"] != qparams["layer1.0.relu@output#1.scale"]
    # conv1 feeds the ReLU, which quantizes for it; conv2's output meets the skip, changed in place
    assert "layer1.0.conv1@output" not in keys and "layer1.0.conv2@output" in keys
    # conv2 reads the ReLU's quantized output as it is; the first block's conv1 reads it max-pooled
    assert "layer1.0.conv2" not in keys and "layer2.0.conv1" not in keys
    assert torch.equal(qparams["layer1.0.conv1.scale"], qparams["relu@output.scale"])
    assert "conv1" in keys and "fc" in keys  # the model's input and the pooled features have no writer


def test_each_relu_output_is_on_its_grid_and_nothing_is_rounded_twice():
    model = small_resnet()
    seen = {}
    with surgery.quantize(model, weights=None, activations=A8, target="onnx", calibration=batches()) as handle:
        after = model.layer1[0].relu.register_forward_hook(lambda m, a, out: seen.setdefault(len(seen), out.clone()))
        with torch.no_grad():
            model(batches(1)[0])
        after.remove()
        for call, key in enumerate(("layer1.0.relu@output", "layer1.0.relu@output#1")):
            quantizer = handle.activations[key]
            steps = seen[call] / quantizer.scale
            assert torch.allclose(steps, steps.round(), atol=1e-3), key  # on the grid, as QuantizeLinear writes
            assert (seen[call] >= 0).all()


def test_saved_parameters_reattach_with_equal_outputs(tmp_path):
    model, calibration = small_resnet(), batches()
    x = batches(1, 40)[0]
    with surgery.quantize(model, weights=None, activations=A8, where="tensors", calibration=calibration) as handle:
        expected = model(x)
        handle.save_qparams(tmp_path / "q.safetensors")
    with surgery.quantize(
        model, weights=None, activations=A8, where="tensors", qparams=tmp_path / "q.safetensors", calibration=[x]
    ):
        assert torch.equal(model(x), expected)
    assert not torch.equal(model(x), expected)  # restored: the float model again


class Repeated(nn.Module):
    """One Linear and one ReLU run ``times`` times: what calibration saw fixes the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.relu = nn.Linear(8, 8), nn.ReLU()

    def forward(self, x: torch.Tensor, times: int = 1) -> torch.Tensor:
        for _ in range(times):
            x = self.relu(self.linear(x))
        return x


def test_a_module_run_more_often_than_in_calibration_is_one_line():
    model = Repeated().eval()
    calibration = [torch.randn(4, 8) for _ in range(2)]
    with surgery.quantize(model, weights=None, activations=A8, where="tensors", calibration=calibration):
        model(torch.randn(4, 8))
        with pytest.raises(ConfigError, match="relu ran 2 times in one forward where calibration saw 1"):
            model(torch.randn(4, 8), times=2)
        model(torch.randn(4, 8))  # the next forward starts again at the first call


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"train": True}, "set train=false"),
        ({"activations": surgery.GridSpec(bits=8, per_channel=True)}, "per-tensor activations"),
        ({"calibration": None, "qparams": {}}, "holds no activation parameters"),
    ],
)
def test_where_tensors_refusals_are_one_line_and_leave_the_model_as_it_was(settings, message):
    model = small_resnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options = {"weights": None, "activations": A8, "where": "tensors", "calibration": batches(2)} | settings
    with pytest.raises((ConfigError, CheckpointError), match=message) as error:
        surgery.quantize(model, **options)
    assert "\n" not in str(error.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


# ------------------------------------------------------------------ found by review


def test_saved_parameters_reattach_without_calibration():
    model, x = small_resnet(), batches(1, 40)[0]
    with surgery.quantize(model, weights=None, activations=A8, where="tensors", calibration=batches()) as handle:
        expected, saved = model(x), handle.qparams()
    assert int(saved["layer1.0.relu@output#1.runs"]) == 2
    with surgery.quantize(model, weights=None, activations=A8, where="tensors", qparams=saved):
        assert torch.equal(model(x), expected)


class TwoLayers(nn.Module):
    """``b(relu(a(x)))`` with a functional relu."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_a_functional_relu_is_found_in_frozen_models_and_under_inference_mode():
    calibration = [torch.randn(4, 8) for _ in range(2)]
    found = []
    for frozen, inference in ((False, False), (True, False), (True, True)):
        torch.manual_seed(0)
        model = TwoLayers().eval().requires_grad_(not frozen)
        with torch.inference_mode(inference):
            handle = surgery.quantize(model, weights=None, activations=A8, where="tensors", calibration=calibration)
        found.append(set(handle.activations))
        assert all(p.requires_grad is not frozen for p in model.parameters())
        handle.restore()
    assert found[0] == found[1] == found[2] == {"a", "b", "b@output"}  # a's output rounds after the relu, in b


def test_a_layer_reading_quantized_and_unquantized_tensors_is_one_line():
    model = Repeated().eval()
    calibration = [{"x": torch.randn(4, 8), "times": 3} for _ in range(2)]
    with pytest.raises(ConfigError, match="linear reads a quantized tensor as it is on some calls and not on others"):
        surgery.quantize(model, weights=None, activations=A8, where="tensors", calibration=calibration)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_selected_relu_is_quantized_per_call_like_any_other():
    model = Repeated().eval()
    calibration = [torch.randn(4, 8) for _ in range(2)]
    with surgery.quantize(
        model, weights=None, activations=A8, where="tensors", select=["linear", "relu"], calibration=calibration
    ) as handle:
        assert set(handle.activations) == {"linear", "relu@output"}
        model(torch.randn(4, 8))


class DroppedInPlace(nn.Module):
    """An in-place ReLU whose return value is dropped: ``b`` reads ``h`` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.relu = nn.Linear(8, 16), nn.Linear(16, 4), nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.relu(h)
        return self.b(h)


def test_an_in_place_relu_is_quantized_in_place():
    torch.manual_seed(0)
    model, calibration = DroppedInPlace().eval(), [torch.randn(4, 8) for _ in range(2)]
    with surgery.quantize(model, weights=None, activations=A8, where="tensors", calibration=calibration) as handle:
        assert "b" not in handle.activations  # b reads what the ReLU's quantizer wrote
        seen = []
        model.b.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
        with torch.no_grad():
            model(torch.randn(4, 8))
        steps = seen[0] / handle.activations["relu@output"].scale
        assert torch.allclose(steps, steps.round(), atol=1e-3)


def test_a_per_call_quantizer_outside_a_whole_forward_is_one_line():
    model = small_resnet()
    with surgery.quantize(model, weights=None, activations=A8, where="tensors", calibration=batches()):
        with pytest.raises(ConfigError, match="ran outside a forward of the whole model"):
            model.layer1(torch.randn(1, 64, 8, 8))
        with pytest.raises(RuntimeError):
            model(torch.randn(1, 5, 32, 32))  # fails inside the forward: the next one starts afresh
        model(batches(1)[0])


def test_a_one_pass_iterator_of_batches_calibrates_like_the_list():
    data = batches(3)
    scales = []
    for calibration in (data, iter(data)):
        model = small_resnet()
        with surgery.quantize(model, weights=None, activations=A8, where="tensors", calibration=calibration) as h:
            scales.append(h.qparams())
    assert scales[0].keys() == scales[1].keys()
    assert all(torch.equal(scales[0][k], scales[1][k]) for k in scales[0])
