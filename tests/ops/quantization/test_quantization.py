"""surgery.quantize: numerics vs torch's fused ops and torch.ao observers, calibration, bad input,
handles (restore, bake, re-attach from saved qparams, copies), composition with pruning, rollback."""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torchvision
from support import Attention, Tied, edit_in_place  # tests/support.py
from torch import nn
from torch.ao.quantization.observer import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)
from torch.nn import functional as F

import surgery
from surgery import GridSpec
from surgery.core.errors import CheckpointError, ConfigError, ConfigTypeError
from surgery.ops.numerics.observers import NonFiniteError
from surgery.ops.quantization import qparams as qparams_module
from surgery.ops.quantization import quantization
from surgery.ops.quantization.quantization import ActivationQuantizer, WeightQuantizer
from surgery.testing import collect, module_hook_counts, snapshot, snapshot_differences

W8 = GridSpec(bits=8, symmetric=True, per_channel=True)  # torch.ao's default weight scheme
A8 = GridSpec(bits=8)  # affine quint8 per tensor: torch.ao's default activation scheme
SPECS = [
    pytest.param(GridSpec(bits=8, symmetric=True, per_channel=True), id="sym-per-channel"),
    pytest.param(GridSpec(bits=8, symmetric=False, per_channel=True), id="affine-per-channel"),
    pytest.param(GridSpec(bits=8, symmetric=True, per_channel=False), id="sym-per-tensor"),
    pytest.param(GridSpec(bits=8, symmetric=False, per_channel=False), id="affine-per-tensor"),
]
MLP_WEIGHTS = ["0.weight", "2.weight", "4.weight"]
CONV_WEIGHTS = ["conv1.weight", "conv2.weight", "fc.weight"]


def hooks_on(model: nn.Module) -> int:
    return sum(module_hook_counts(model).values())


def mlp_batches(count: int = 3, seed: int = 10) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 8, generator=g) * (1 + i) for i in range(count)]


def image_batches(count: int = 2, seed: int = 11) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 12, 12, generator=g) for _ in range(count)]


def fused(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int | None, spec: GridSpec
) -> torch.Tensor:
    """torch's own fake-quantization op, called directly."""
    quant_min, quant_max = spec.quant_range
    if axis is None:
        return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, quant_min, quant_max)
    return torch.fake_quantize_per_channel_affine(x, scale, zero_point, axis, quant_min, quant_max)


def originals(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    return {name: model.get_parameter(name).detach().clone() for name in names}


class Recorder:
    """Forward hooks recording what each named module received and returned (removed on exit)."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.modules = {name: model.get_submodule(name) for name in names}
        self.inputs: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        self.outputs: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        self.hooks = []

    def __enter__(self) -> Recorder:
        for name, module in self.modules.items():

            def hook(module, args, output, name=name):
                self.inputs[name].append(args[0].detach().clone())
                self.outputs[name].append(output.detach().clone())

            self.hooks.append(module.register_forward_hook(hook))
        return self

    def __exit__(self, *exc_info) -> None:
        for hook in self.hooks:
            hook.remove()


def raw_outputs(model: nn.Module, names: list[str], data: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """What each named layer returns over ``data`` in the model as it is now."""
    with Recorder(model, names) as recorder, torch.no_grad():
        for x in data:
            model(x)
    return recorder.outputs


def ao_observer(spec: GridSpec, axis: int | None):
    """The torch.ao observer for ``spec`` (a custom quant range, so also below 8 bits)."""
    quant_min, quant_max = spec.quant_range
    kwargs = {"dtype": torch.qint8 if spec.symmetric else torch.quint8, "quant_min": quant_min, "quant_max": quant_max}
    moving = spec.observer == "moving_average"
    if moving:
        kwargs["averaging_constant"] = spec.averaging
    if axis is None:
        cls = MovingAverageMinMaxObserver if moving else MinMaxObserver
        return cls(qscheme=torch.per_tensor_symmetric if spec.symmetric else torch.per_tensor_affine, **kwargs)
    cls = MovingAveragePerChannelMinMaxObserver if moving else PerChannelMinMaxObserver
    return cls(
        ch_axis=axis, qscheme=torch.per_channel_symmetric if spec.symmetric else torch.per_channel_affine, **kwargs
    )


def assert_qparams_equal(quantizer, reference) -> None:
    """Our (scale, int32 zero point) equal torch.ao's calculate_qparams() value for value."""
    scale, zero_point = reference.calculate_qparams()
    assert quantizer.scale.dtype == torch.float32 and quantizer.zero_point.dtype == torch.int32
    assert torch.equal(quantizer.scale.reshape(-1), scale.reshape(-1))
    assert torch.equal(quantizer.zero_point.reshape(-1).long(), zero_point.reshape(-1).long())


def distinct_per_channel(t: torch.Tensor, axis: int | None) -> int:
    """The largest number of distinct values in one channel (the whole tensor if ``axis`` is None)."""
    if axis is None:
        return t.unique().numel()
    flat = t.movedim(axis, 0).reshape(t.shape[axis], -1)
    return max(row.unique().numel() for row in flat)


# --- numerics: weights ----------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_quantized_weights_equal_torch_fused_op_on_the_original_weights(convnet, spec):
    before = originals(convnet, CONV_WEIGHTS)
    others = {k: v.clone() for k, v in convnet.state_dict().items() if k not in CONV_WEIGHTS}
    with surgery.quantize(convnet, weights=spec, progress=False) as handle:
        assert list(handle.weights) == CONV_WEIGHTS  # default selection: every conv and linear
        state = convnet.state_dict()
        assert all(torch.equal(state[k], v) for k, v in others.items())  # biases and batch norm untouched
        for name, quantizer in handle.weights.items():
            assert quantizer.axis == (0 if spec.per_channel else None)
            expected = fused(before[name], quantizer.scale, quantizer.zero_point, quantizer.axis, spec)
            now = convnet.get_parameter(name).detach()
            assert torch.equal(now, expected)
            assert not torch.equal(now, before[name])


@pytest.mark.parametrize("spec", SPECS)
def test_weight_qparams_equal_torch_ao_observers(mlp, spec):
    before = originals(mlp, MLP_WEIGHTS)
    with surgery.quantize(mlp, weights=spec, progress=False) as handle:
        for name, quantizer in handle.weights.items():
            reference = ao_observer(spec, 0 if spec.per_channel else None)
            reference(before[name])
            assert_qparams_equal(quantizer, reference)


def test_default_weight_scheme_is_torch_ao_per_channel_symmetric_qint8(convnet):
    before = originals(convnet, CONV_WEIGHTS)
    with surgery.quantize(convnet, progress=False) as handle:
        for name, quantizer in handle.weights.items():
            reference = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
            reference(before[name])
            assert_qparams_equal(quantizer, reference)
            assert not quantizer.zero_point.any()


def test_transposed_convolution_weights_use_the_output_channel_axis():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(4, 6, 3), nn.Conv1d(2, 3, 3)).eval()
    before = originals(model, ["0.weight", "1.weight"])
    with surgery.quantize(model, select=["0", "1"], progress=False) as handle:
        assert handle.weights["0.weight"].axis == 1 and handle.weights["0.weight"].scale.shape == (6,)
        assert handle.weights["1.weight"].axis == 0 and handle.weights["1.weight"].scale.shape == (3,)
        for name, q in handle.weights.items():
            assert torch.equal(
                model.get_parameter(name).detach(), fused(before[name], q.scale, q.zero_point, q.axis, W8)
            )


# --- numerics: activations ------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_activation_outputs_equal_torch_fused_op_on_the_unquantized_output(convnet, spec):
    data = image_batches()
    names = ["conv1", "conv2", "fc"]
    with surgery.quantize(convnet, weights=W8, activations=spec, calibration=data, progress=False) as handle:
        assert list(handle.activations) == names
        with Recorder(convnet, names) as seen, torch.no_grad():  # registered after: sees quantized outputs
            convnet(data[0])
        for name in names:
            quantizer = handle.activations[name]
            assert quantizer.axis == ((1 if name != "fc" else -1) if spec.per_channel else None)
            layer = convnet.get_submodule(name)
            with torch.no_grad():
                unquantized = layer.forward(seen.inputs[name][0])  # forward() skips the hooks
            axis = None if quantizer.axis is None else quantizer.axis % unquantized.dim()
            expected = fused(unquantized, quantizer.scale, quantizer.zero_point, axis, spec)
            assert torch.equal(seen.outputs[name][0], expected)
            assert not torch.equal(seen.outputs[name][0], unquantized)


@pytest.mark.parametrize("observer", ["minmax", "moving_average"])
@pytest.mark.parametrize("spec", SPECS)
def test_activation_qparams_equal_torch_ao_observers_fed_the_same_data(convnet, spec, observer):
    spec = GridSpec(bits=8, symmetric=spec.symmetric, per_channel=spec.per_channel, observer=observer)
    data = image_batches(count=4)
    names = ["conv1", "conv2", "fc"]
    seen = raw_outputs(convnet, names, data)  # weights=None: calibration sees these float outputs
    with surgery.quantize(convnet, weights=None, activations=spec, calibration=data, progress=False) as handle:
        for name in names:
            reference = ao_observer(spec, (1 if spec.per_channel else None))
            for output in seen[name]:
                reference(output)
            assert_qparams_equal(handle.activations[name], reference)


def test_moving_average_default_constant_is_torch_ao_default(mlp):
    data = mlp_batches(count=5)
    seen = raw_outputs(mlp, ["2"], data)
    reference = MovingAverageMinMaxObserver(averaging_constant=0.01, dtype=torch.quint8)
    for output in seen["2"]:
        reference(output)
    with surgery.quantize(
        mlp,
        weights=None,
        activations=GridSpec(observer="moving_average"),
        select="2",
        calibration=data,
        progress=False,
    ) as handle:
        assert_qparams_equal(handle.activations["2"], reference)
        minmax = MinMaxObserver(dtype=torch.quint8)
        for output in seen["2"]:
            minmax(output)
        assert not torch.equal(handle.activations["2"].scale.reshape(1), minmax.calculate_qparams()[0])


def test_where_input_quantizes_the_first_input_of_the_layer(mlp, mlp_input):
    data = mlp_batches()
    seen = raw_outputs(mlp, ["1"], data)  # the ReLU output is what layer 2 receives
    with surgery.quantize(
        mlp, weights=None, activations=A8, select="2", where="input", calibration=data, progress=False
    ) as handle:
        quantizer = handle.activations["2"]
        reference = ao_observer(A8, None)
        for output in seen["1"]:
            reference(output)
        assert_qparams_equal(quantizer, reference)
        with torch.no_grad():
            hidden = mlp[1](mlp[0](mlp_input))
            expected = mlp[4](
                mlp[3](
                    F.linear(fused(hidden, quantizer.scale, quantizer.zero_point, None, A8), mlp[2].weight, mlp[2].bias)
                )
            )
        assert torch.equal(collect(mlp, [mlp_input])[0], expected)


# --- every bit width ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])
def test_every_bit_width_quantizes_weights_and_activations(mlp, mlp_input, bits, per_channel, symmetric):
    spec = GridSpec(bits=bits, symmetric=symmetric, per_channel=per_channel)
    before_all = snapshot(mlp)
    before = originals(mlp, MLP_WEIGHTS)
    with surgery.quantize(mlp, weights=spec, activations=spec, calibration=mlp_batches(), progress=False) as handle:
        for name, quantizer in handle.weights.items():
            weight = mlp.get_parameter(name).detach()
            reference = ao_observer(spec, quantizer.axis)
            reference(before[name])
            assert_qparams_equal(quantizer, reference)
            assert torch.equal(weight, fused(before[name], quantizer.scale, quantizer.zero_point, quantizer.axis, spec))
            assert distinct_per_channel(weight, quantizer.axis) <= 2**bits
        with Recorder(mlp, ["0", "2", "4"]) as seen, torch.no_grad():
            mlp(mlp_input)
        for outputs in seen.outputs.values():
            assert distinct_per_channel(outputs[0], -1 if per_channel else None) <= 2**bits
    assert snapshot_differences(before_all, snapshot(mlp)) == []


def test_fewer_bits_give_more_error(mlp_factory, mlp_input):
    reference = mlp_factory()
    errors = []
    for bits in (2, 4, 8):
        model = mlp_factory()
        with surgery.quantize(model, weights=GridSpec(bits=bits, symmetric=True, per_channel=True), progress=False):
            errors.append(surgery.compare(reference, model, mlp_input).max_abs)
    assert errors[0] > errors[1] > errors[2] > 0


def test_percentile_observer_clips_a_weight_outlier():
    torch.manual_seed(0)
    layers = {kind: nn.Linear(256, 256) for kind in ("minmax", "percentile")}
    for layer in layers.values():
        with torch.no_grad():
            layer.weight.copy_(torch.randn(256, 256, generator=torch.Generator().manual_seed(1)) * 0.05)
            layer.weight[3, 7] = 50.0
    scales = {}
    for kind, layer in layers.items():
        with surgery.quantize(layer, weights=GridSpec(bits=8, symmetric=True, observer=kind), progress=False) as h:
            scales[kind] = h.weights["weight"].scale
            clipped_outlier = layer.weight[3, 7].item()
    assert scales["minmax"] == pytest.approx(50.0 / 127.5)
    assert scales["percentile"] < scales["minmax"] / 50
    assert clipped_outlier < 1.0  # the outlier is clipped to the top of the much smaller grid


def test_percentile_observer_clips_an_activation_outlier():
    model = nn.Sequential(nn.Identity()).eval()
    data = [torch.randn(64, 256, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    data[1][5, 5] = 1e4
    scales = {}
    for kind in ("minmax", "percentile"):
        with surgery.quantize(
            model, weights=None, activations=GridSpec(observer=kind), select="0", calibration=data, progress=False
        ) as handle:
            scales[kind] = handle.activations["0"].scale
    assert scales["minmax"] > 1e4 / 255
    assert scales["percentile"] < scales["minmax"] / 100


# --- calibration ----------------------------------------------------------------------------------


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x)


def test_a_layer_that_saw_no_calibration_data_is_named_and_nothing_changes():
    torch.manual_seed(0)
    model = WithUnused().eval()
    before = snapshot(model)
    with pytest.raises(ConfigError, match="unused") as info:
        surgery.quantize(model, activations=A8, calibration=mlp_batches(), progress=False)
    assert "no data" in str(info.value)
    assert snapshot_differences(before, snapshot(model)) == []  # the weights quantized first are put back
    assert hooks_on(model) == 0
    with surgery.quantize(model, activations=A8, exclude="unused", calibration=mlp_batches(), progress=False):
        pass


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_calibration_data_raises_and_nothing_changes(convnet, bad):
    convnet.train()
    before = snapshot(convnet)
    data = image_batches(count=3)
    data[1][0, 1, 2, 3] = bad
    with pytest.raises(NonFiniteError, match="batch 1") as info:
        surgery.quantize(convnet, activations=A8, calibration=data, progress=False)
    assert isinstance(info.value, ConfigError)
    assert snapshot_differences(before, snapshot(convnet)) == []  # also the batch-norm running stats
    assert all(m.training for m in convnet.modules())


def test_non_finite_values_reached_inside_the_model_name_the_layer(mlp):
    with torch.no_grad():
        mlp[2].weight.fill_(1e38)  # finite weights whose products overflow to inf
    before = snapshot(mlp)
    data = [torch.ones(2, 8)] * 2
    with pytest.raises(NonFiniteError, match=r"calibration='2'.*NaN or Inf") as info:
        surgery.quantize(mlp, weights=None, activations=A8, calibration=data, progress=False)
    assert isinstance(info.value, ConfigError)
    assert snapshot_differences(before, snapshot(mlp)) == []


@pytest.mark.parametrize("weights", [None, W8], ids=["activations-only", "weights-too"])
def test_activations_need_calibration_or_qparams(mlp, weights):
    before = snapshot(mlp)
    with pytest.raises(ConfigError) as info:
        surgery.quantize(mlp, weights=weights, activations=A8)
    assert info.value.field == "quantize.calibration"
    assert "quantize.calibration" in str(info.value)
    assert snapshot_differences(before, snapshot(mlp)) == []


def test_calibration_runs_in_eval_mode_without_touching_batch_norm_stats(convnet):
    convnet.train()
    buffers = {k: v.clone() for k, v in convnet.named_buffers()}
    modes = []
    hook = convnet.bn1.register_forward_pre_hook(lambda m, args: modes.append(m.training))
    try:
        with surgery.quantize(convnet, weights=None, activations=A8, calibration=image_batches(), progress=False):
            assert all(torch.equal(v, buffers[k]) for k, v in convnet.named_buffers())
            assert all(m.training for m in convnet.modules())
    finally:
        hook.remove()
    assert modes == [False, False]


def test_calibration_accepts_a_tensor_a_generator_or_tuples(mlp_factory):
    data = mlp_batches()
    scales = []
    for calibration in (torch.cat(data), (x for x in [torch.cat(data)]), [(torch.cat(data),)]):
        model = mlp_factory()
        with surgery.quantize(model, weights=None, activations=A8, calibration=calibration, progress=False) as handle:
            scales.append(torch.stack([q.scale for q in handle.activations.values()]))
    assert torch.equal(scales[0], scales[1]) and torch.equal(scales[0], scales[2])


@pytest.mark.parametrize("terminal", [True, False])
@pytest.mark.parametrize("progress", [True, False])
def test_calibration_shows_a_progress_bar_on_a_terminal_unless_disabled(mlp, capsys, monkeypatch, progress, terminal):
    """Not on a pipe or a log file: there a bar's carriage returns would glue the next line to it."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    with surgery.quantize(mlp, weights=None, activations=A8, calibration=mlp_batches(), progress=progress):
        pass
    assert ("calibrating" in capsys.readouterr().err) is (progress and terminal)


# --- bad input -------------------------------------------------------------------------------------

CAL = mlp_batches()
BAD_INPUTS = [
    ({"weights": {"bits": 1}}, "quantize.weights.bits", ConfigError),
    ({"weights": {"bits": 9}}, "quantize.weights.bits", ConfigError),
    ({"weights": {"bits": True}}, "quantize.weights.bits", ConfigTypeError),
    ({"weights": {"bits": "8"}}, "quantize.weights.bits", ConfigTypeError),
    ({"weights": {"bits": 9}}, "quantize.weights.bits", ConfigError),
    ({"weights": {"bitz": 8}}, "quantize.weights", ConfigError),
    ({"weights": 8}, "quantize.weights", ConfigError),
    ({"weights": {"observer": "histogram"}}, "quantize.weights.observer", ConfigError),
    ({"weights": None, "activations": {"bits": 1}, "calibration": CAL}, "quantize.activations.bits", ConfigError),
    ({"weights": None, "activations": {"bits": 9}, "calibration": CAL}, "quantize.activations.bits", ConfigError),
    ({"activations": {"bits": True}, "calibration": CAL}, "quantize.activations.bits", ConfigTypeError),
    ({"activations": {"bits": "8"}, "calibration": CAL}, "quantize.activations.bits", ConfigTypeError),
    ({"activations": {"observer": "kl"}, "calibration": CAL}, "quantize.activations.observer", ConfigError),
    ({"activations": {"percentile": 20}, "calibration": CAL}, "quantize.activations.percentile", ConfigError),
    ({"weights": None}, "quantize", ConfigError),
    ({"activations": A8, "calibration": CAL, "where": "middle"}, "quantize.where", ConfigError),
    ({"activations": A8}, "quantize.calibration", ConfigError),
    ({"select": "9"}, "quantize.select", ConfigError),
    ({"select": ["0", "9"]}, "quantize.select", ConfigError),
    ({"exclude": "9"}, "quantize.exclude", ConfigError),
    ({"select": "0", "exclude": "0"}, "quantize.select", ConfigError),
]


@pytest.mark.parametrize("kwargs,field,error", BAD_INPUTS, ids=[str(k) for k, _, _ in BAD_INPUTS])
def test_bad_input_raises_config_error_naming_the_field_and_changes_nothing(mlp, kwargs, field, error):
    before = snapshot(mlp)
    with pytest.raises(error) as info:
        surgery.quantize(mlp, progress=False, **kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}=")
    assert snapshot_differences(before, snapshot(mlp)) == []
    with surgery.quantize(mlp, progress=False):  # the failed call claimed nothing
        pass


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.fc(x))


NO_CHANNEL_AXIS = [
    pytest.param(
        "convnet", ["conv1", "bn1"], {"weights": W8}, "quantize.weights.per_channel", id="BatchNorm2d-weights"
    ),
    pytest.param("normed", ["fc", "norm"], {"weights": W8}, "quantize.weights.per_channel", id="LayerNorm-weights"),
    pytest.param(
        "normed",
        ["fc", "norm"],
        {"weights": None, "activations": GridSpec(per_channel=True)},
        "quantize.activations.per_channel",
        id="LayerNorm-activations",
    ),
    pytest.param(
        "convnet",
        ["conv1", "bn1"],
        {"weights": None, "activations": GridSpec(per_channel=True)},
        "quantize.activations.per_channel",
        id="BatchNorm2d-activations",
    ),
]


@pytest.mark.parametrize("which,layers,kwargs,field", NO_CHANNEL_AXIS)
def test_per_channel_on_a_layer_without_channel_axis_is_a_config_error(convnet, which, layers, kwargs, field):
    torch.manual_seed(0)
    model = convnet if which == "convnet" else Normed().eval()
    data = image_batches() if which == "convnet" else mlp_batches()
    before = snapshot(model)
    with pytest.raises(ConfigError, match="no channel axis") as info:
        surgery.quantize(model, select=layers, calibration=data, progress=False, **kwargs)
    assert info.value.field == field
    assert type(model.get_submodule(layers[1])).__name__ in str(info.value)
    assert snapshot_differences(before, snapshot(model)) == []
    assert hooks_on(model) == 0


def test_per_tensor_on_a_normalisation_layer_is_fine(convnet):
    with surgery.quantize(convnet, weights=GridSpec(symmetric=True), select="bn1", progress=False) as handle:
        assert list(handle.weights) == ["bn1.weight"] and handle.weights["bn1.weight"].scale.shape == ()


def test_non_floating_weight_is_a_config_error_and_changes_nothing():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = nn.Parameter(torch.ones(4, 4, dtype=torch.int8), requires_grad=False)
    before = snapshot(model)
    with pytest.raises(ConfigError, match="int8") as info:
        surgery.quantize(model, progress=False)
    assert info.value.field == "quantize.select" and info.value.value == "1"
    assert snapshot_differences(before, snapshot(model)) == []
    assert hooks_on(model) == 0


class ArgMax(nn.Module):
    def forward(self, x):
        return x.argmax(dim=-1)


def test_a_layer_with_integer_output_is_a_config_error_and_changes_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), ArgMax()).eval()
    before = snapshot(model)
    with pytest.raises(ConfigError, match="int64") as info:
        surgery.quantize(model, activations=A8, select=["0", "1"], calibration=mlp_batches(), progress=False)
    assert info.value.field == "quantize.select" and info.value.value == "1"
    assert snapshot_differences(before, snapshot(model)) == []  # layer 0's weight was quantized, then put back
    assert hooks_on(model) == 0


def test_qparams_that_do_not_fit_are_checkpoint_errors(mlp, tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        surgery.quantize(mlp, weights=None, activations=A8, qparams=tmp_path / "missing.safetensors")
    handle = surgery.quantize(mlp, weights=None, activations=A8, select="0", calibration=mlp_batches(), progress=False)
    saved = handle.qparams()
    handle.restore()
    before = snapshot(mlp)
    with pytest.raises(CheckpointError, match="2"):  # saved for layer 0 only
        surgery.quantize(mlp, weights=None, activations=A8, qparams=saved)
    partial = {"0.scale": saved["0.scale"]}
    with pytest.raises(CheckpointError, match="0"):
        surgery.quantize(mlp, weights=None, activations=A8, select="0", qparams=partial)
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="unreadable"):
        surgery.quantize(mlp, weights=None, activations=A8, qparams=tmp_path / "garbage.safetensors")
    assert snapshot_differences(before, snapshot(mlp)) == []


def test_per_channel_qparams_do_not_load_into_a_per_tensor_setting(mlp, mlp_input):
    handle = surgery.quantize(
        mlp, weights=None, activations=GridSpec(per_channel=True), calibration=mlp_batches(), progress=False
    )
    saved = handle.qparams()
    handle.restore()
    before = snapshot(mlp)
    with pytest.raises(CheckpointError, match="shape"):
        surgery.quantize(mlp, weights=None, activations=A8, qparams=saved)
    assert snapshot_differences(before, snapshot(mlp)) == []


# --- handles ---------------------------------------------------------------------------------------

SETTINGS = [
    pytest.param({"weights": W8}, id="weights"),
    pytest.param({"weights": None, "activations": A8}, id="activations"),
    pytest.param({"weights": W8, "activations": A8}, id="both"),
    pytest.param(
        {"weights": GridSpec(bits=4), "activations": GridSpec(bits=3, per_channel=True, observer="percentile")},
        id="low-bits",
    ),
    pytest.param({"weights": W8, "activations": A8, "where": "input"}, id="inputs"),
]


@pytest.mark.parametrize("kwargs", SETTINGS)
def test_restore_is_bit_exact(convnet, image_input, kwargs):
    before = snapshot(convnet)
    expected = collect(convnet, [image_input])[0]
    handle = surgery.quantize(convnet, calibration=image_batches(), progress=False, **kwargs)
    assert not torch.equal(collect(convnet, [image_input])[0], expected)
    handle.restore()
    assert handle.state == "restored"
    assert snapshot_differences(before, snapshot(convnet)) == []
    assert torch.equal(collect(convnet, [image_input])[0], expected)


def test_restore_puts_back_negative_zeros_and_exact_bits():
    layer = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[-0.0, 1e-38, -1e-45, 3.0]] * 4))
    bits = layer.weight.detach().clone().view(torch.int32)
    with surgery.quantize(layer, progress=False):
        assert not torch.equal(layer.weight.detach().view(torch.int32), bits)
    assert torch.equal(layer.weight.detach().view(torch.int32), bits)


def test_state_dict_keys_parameters_and_classes_unchanged_while_attached(convnet):
    keys = list(convnet.state_dict())
    params = dict(convnet.named_parameters())
    buffers = dict(convnet.named_buffers())
    classes = {n: type(m) for n, m in convnet.named_modules()}
    with surgery.quantize(convnet, weights=W8, activations=A8, calibration=image_batches(), progress=False):
        assert list(convnet.state_dict()) == keys
        assert dict(convnet.named_parameters()) == params  # same Parameter objects
        assert all(type(p) is nn.Parameter and p.requires_grad for p in convnet.parameters())
        assert dict(convnet.named_buffers()) == buffers
        assert {n: type(m) for n, m in convnet.named_modules()} == classes


def test_bake_weights_only_keeps_outputs_removes_hooks_and_loads_strictly(convnet, convnet_factory, image_input):
    params = dict(convnet.named_parameters())
    handle = surgery.quantize(convnet, weights=W8, progress=False)
    quantizers = dict(handle.weights)
    hooked = collect(convnet, [image_input])[0]
    assert handle.bake() is convnet
    assert handle.state == "baked"
    assert hooks_on(convnet) == 0
    assert dict(convnet.named_parameters()) == params
    assert torch.equal(collect(convnet, [image_input])[0], hooked)
    for name, q in quantizers.items():  # still on the quantization grid
        weight = convnet.get_parameter(name).detach()
        assert torch.equal(fused(weight, q.scale, q.zero_point, q.axis, W8), weight)
    fresh = convnet_factory(seed=3)
    fresh.load_state_dict(convnet.state_dict(), strict=True)
    assert torch.equal(collect(fresh, [image_input])[0], hooked)


def test_baked_weights_are_no_longer_enforced(mlp, mlp_input):
    surgery.quantize(mlp, progress=False).bake()
    with torch.no_grad():
        mlp[0].weight.fill_(0.123456)
    mlp(mlp_input)
    assert mlp[0].weight.eq(0.123456).all()


def test_bake_activations_then_reattach_from_saved_qparams(convnet, convnet_factory, image_input, tmp_path):
    data = image_batches()
    handle = surgery.quantize(convnet, weights=W8, activations=A8, calibration=data, progress=False)
    hooked = collect(convnet, [image_input])[0]
    handle.bake()
    assert hooks_on(convnet) == 0
    baked = snapshot(convnet)
    assert not torch.equal(collect(convnet, [image_input])[0], hooked)  # activation hooks are gone
    path = handle.save_qparams(tmp_path / "model.qparams.safetensors")
    assert path.is_file()
    fresh = convnet_factory(seed=4)
    fresh.load_state_dict(convnet.state_dict(), strict=True)
    # No calibration: computing batches at all would fail.
    with mock.patch.object(qparams_module, "run_batches", side_effect=AssertionError("calibrated")):
        for model, qparams in ((convnet, handle.qparams()), (convnet, path), (fresh, path)):
            with surgery.quantize(model, weights=None, activations=A8, qparams=qparams) as again:
                assert list(again.activations) == list(handle.activations)
                assert torch.equal(collect(model, [image_input])[0], hooked)
    assert snapshot_differences(baked, snapshot(convnet)) == []
    assert hooks_on(fresh) == 0


def test_saved_qparams_hold_every_layer_scale_and_zero_point(convnet, tmp_path):
    from safetensors.torch import load_file

    with surgery.quantize(
        convnet, weights=None, activations=GridSpec(per_channel=True), calibration=image_batches(), progress=False
    ) as handle:
        saved = load_file(str(handle.save_qparams(tmp_path / "q.safetensors")))
        assert sorted(saved) == sorted(f"{n}.{k}" for n in ("conv1", "conv2", "fc") for k in ("scale", "zero_point"))
        for name, quantizer in handle.activations.items():
            assert saved[f"{name}.scale"].dtype == torch.float32
            assert saved[f"{name}.zero_point"].dtype == torch.int32
            assert torch.equal(saved[f"{name}.scale"], quantizer.scale)
            assert torch.equal(saved[f"{name}.zero_point"], quantizer.zero_point)
        assert saved["conv1.scale"].shape == (8,) and saved["fc.scale"].shape == (5,)


def test_restore_and_bake_are_idempotent(mlp, mlp_input):
    before = snapshot(mlp)
    handle = surgery.quantize(mlp, activations=A8, calibration=mlp_batches(), progress=False)
    handle.restore()
    with torch.no_grad():
        mlp[0].weight[0, 0] = 42.0  # a second restore must not put anything back
    handle.restore()
    assert mlp[0].weight[0, 0].item() == 42.0
    with torch.no_grad():
        mlp[0].weight[0, 0] = before.tensors["param:0.weight"][0, 0]
    assert snapshot_differences(before, snapshot(mlp)) == []

    handle = surgery.quantize(mlp, progress=False)
    baked_output = collect(mlp, [mlp_input])[0]
    assert handle.bake() is mlp and handle.bake() is mlp
    baked = {k: v.clone() for k, v in mlp.state_dict().items()}
    handle.restore()  # after bake: nothing to undo
    assert handle.state == "baked"
    assert all(torch.equal(mlp.state_dict()[k], v) for k, v in baked.items())
    assert torch.equal(collect(mlp, [mlp_input])[0], baked_output)
    assert hooks_on(mlp) == 0


def test_bake_after_restore_raises(mlp):
    handle = surgery.quantize(mlp, progress=False)
    handle.restore()
    with pytest.raises(RuntimeError, match="restored"):
        handle.bake()


def test_context_manager_restores_on_exit_unless_baked(mlp, mlp_input):
    before = snapshot(mlp)
    expected = collect(mlp, [mlp_input])[0]
    with surgery.quantize(mlp, activations=A8, calibration=mlp_batches(), progress=False) as handle:
        assert isinstance(handle, surgery.QuantizeHandle)
        assert not torch.equal(collect(mlp, [mlp_input])[0], expected)
    assert snapshot_differences(before, snapshot(mlp)) == []
    with pytest.raises(KeyError), surgery.quantize(mlp, progress=False):
        raise KeyError("boom")  # restored on the way out of an exception too
    assert snapshot_differences(before, snapshot(mlp)) == []
    with surgery.quantize(mlp, progress=False) as handle:
        quantized = collect(mlp, [mlp_input])[0]
        handle.bake()
    assert torch.equal(collect(mlp, [mlp_input])[0], quantized)
    assert hooks_on(mlp) == 0


def test_copies_of_a_quantized_model_give_the_same_outputs(convnet, image_input, duplicate):
    handle = surgery.quantize(convnet, weights=W8, activations=A8, calibration=image_batches(), progress=False)
    hooked = collect(convnet, [image_input])[0]
    twin = duplicate(convnet)
    assert torch.equal(collect(twin, [image_input])[0], hooked)
    assert list(twin.state_dict()) == list(convnet.state_dict())
    handle.restore()  # the copy keeps its own hooks and quantized weights
    assert not torch.equal(collect(convnet, [image_input])[0], hooked)
    assert torch.equal(collect(twin, [image_input])[0], hooked)
    # ... and keeps re-quantizing its own weights when they change.
    q = handle.weights["fc.weight"]
    with torch.no_grad():
        twin.fc.weight.add_(0.01)
    twin(image_input)
    weight = twin.fc.weight.detach()
    assert torch.equal(fused(weight, q.scale, q.zero_point, q.axis, W8), weight)


def test_quantized_weights_survive_load_state_dict_while_attached(mlp, mlp_factory, mlp_input):
    dense = mlp_factory(seed=5).state_dict()
    with surgery.quantize(mlp, progress=False) as handle:
        mlp.load_state_dict(dense)
        mlp(mlp_input)
        for name, q in handle.weights.items():  # re-quantized with the frozen qparams
            assert torch.equal(mlp.get_parameter(name).detach(), fused(dense[name], q.scale, q.zero_point, q.axis, W8))


def test_a_weight_read_directly_by_a_parent_is_quantized_after_an_in_place_edit():
    torch.manual_seed(0)
    model = Attention().eval()
    x = torch.randn(2, 5, 16)
    with surgery.quantize(model, select="attn.out_proj", progress=False) as handle:
        q = handle.weights["attn.out_proj.weight"]
        weight = model.attn.out_proj.weight
        edit_in_place(model, 0.003)
        assert not torch.equal(fused(weight.detach(), q.scale, q.zero_point, q.axis, W8), weight.detach())
        model.attn(x, x, x)  # the parent alone: out_proj's own forward never runs
        assert torch.equal(fused(weight.detach(), q.scale, q.zero_point, q.axis, W8), weight.detach())


def test_a_tied_weight_is_quantized_once():
    torch.manual_seed(0)
    model = Tied().eval()
    before = snapshot(model)
    original = model.a.weight.detach().clone()
    with surgery.quantize(model, progress=False) as handle:
        assert list(handle.weights) == ["a.weight"] and model.b.weight is model.a.weight
        q = handle.weights["a.weight"]
        assert torch.equal(model.a.weight.detach(), fused(original, q.scale, q.zero_point, q.axis, W8))
    assert snapshot_differences(before, snapshot(model)) == []


# --- composition with pruning ------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["l1_unstructured", "ln_structured"])
@pytest.mark.parametrize("spec", SPECS)
def test_pruned_zeros_stay_exactly_zero_after_weight_quantization(convnet, spec, method):
    before = snapshot(convnet)
    pruned = surgery.prune(convnet, 0.5, method=method)
    masks = pruned.masks()
    quantized = surgery.quantize(convnet, weights=spec, progress=False)
    for name, mask in masks.items():
        weight = convnet.get_parameter(name).detach()
        assert torch.equal(weight[~mask], torch.zeros(int((~mask).sum())))
        assert weight[mask].ne(0).any()
    surgery.compose(pruned, quantized).restore()
    assert snapshot_differences(before, snapshot(convnet)) == []


def test_restoring_prune_under_quantize_raises_and_changes_nothing(mlp, mlp_input):
    before = snapshot(mlp)
    pruned = surgery.prune(mlp, 0.5)
    quantized = surgery.quantize(mlp, activations=A8, calibration=mlp_batches(), progress=False)
    during = snapshot(mlp)
    output = collect(mlp, [mlp_input])[0]
    with pytest.raises(surgery.AlreadyModifiedError, match="quantize"):
        pruned.restore()
    assert pruned.state == "attached"
    assert snapshot_differences(during, snapshot(mlp)) == []
    assert torch.equal(collect(mlp, [mlp_input])[0], output)
    quantized.restore()
    pruned.restore()
    assert snapshot_differences(before, snapshot(mlp)) == []


def test_restoring_quantize_under_prune_raises(mlp):
    before = snapshot(mlp)
    quantized = surgery.quantize(mlp, progress=False)
    pruned = surgery.prune(mlp, 0.5)
    during = snapshot(mlp)
    with pytest.raises(surgery.AlreadyModifiedError, match="prune"):
        quantized.restore()
    assert quantized.state == "attached"
    assert snapshot_differences(during, snapshot(mlp)) == []
    surgery.compose(quantized, pruned).restore()
    assert snapshot_differences(before, snapshot(mlp)) == []


@pytest.mark.parametrize("spec", SPECS)
def test_compose_restore_gives_back_the_original_bit_exact(convnet, image_input, spec):
    before = snapshot(convnet)
    expected = collect(convnet, [image_input])[0]
    group = surgery.compose(
        surgery.prune(convnet, 0.6),
        surgery.quantize(convnet, weights=spec, activations=A8, calibration=image_batches(), progress=False),
    )
    assert not torch.equal(collect(convnet, [image_input])[0], expected)
    group.restore()
    group.restore()
    assert snapshot_differences(before, snapshot(convnet)) == []
    assert torch.equal(collect(convnet, [image_input])[0], expected)


def test_compose_bake_keeps_zeros_on_the_grid_and_loads_strictly(convnet, convnet_factory, image_input):
    pruned = surgery.prune(convnet, 0.5)
    masks = pruned.masks()
    quantized = surgery.quantize(convnet, progress=False)
    hooked = collect(convnet, [image_input])[0]
    surgery.compose(pruned, quantized).bake()
    assert hooks_on(convnet) == 0
    assert torch.equal(collect(convnet, [image_input])[0], hooked)
    for name, mask in masks.items():
        weight = convnet.get_parameter(name).detach()
        q = quantized.weights[name]
        assert not weight[~mask].any()
        assert torch.equal(fused(weight, q.scale, q.zero_point, q.axis, W8), weight)
    fresh = convnet_factory(seed=6)
    fresh.load_state_dict(convnet.state_dict(), strict=True)
    assert torch.equal(collect(fresh, [image_input])[0], hooked)


@pytest.mark.parametrize("spec", SPECS)
def test_a_forward_after_an_in_place_edit_reapplies_pruning_and_quantization(convnet, image_input, spec):
    with surgery.prune(convnet, 0.5) as pruned, surgery.quantize(convnet, weights=spec, progress=False) as quantized:
        masks = pruned.masks()
        edit_in_place(convnet, 0.003)
        weights = {name: convnet.get_parameter(name) for name in masks}
        assert all(w.detach()[~masks[n]].ne(0).any() for n, w in weights.items()), "the step revives pruned entries"
        off_grid = [
            n
            for n, w in weights.items()
            if not torch.equal(
                fused(
                    w.detach(),
                    quantized.weights[n].scale,
                    quantized.weights[n].zero_point,
                    quantized.weights[n].axis,
                    spec,
                ),
                w.detach(),
            )
        ]
        assert off_grid
        with torch.no_grad():
            convnet(image_input)
        for name, weight in weights.items():
            q = quantized.weights[name]
            w = weight.detach()
            assert not w[~masks[name]].any()
            assert torch.equal(fused(w, q.scale, q.zero_point, q.axis, spec), w)


def test_quantizing_a_pruned_weight_changed_since_the_last_forward_observes_it_pruned(mlp, mlp_input):
    """An optimizer step after the last forward revives pruned entries; quantize must compute its
    scales from the weight as pruning keeps it, not from the revived values."""
    pruned = surgery.prune(mlp, 0.5)
    mask = pruned.masks()["2.weight"]
    with torch.no_grad():
        mlp[2].weight[~mask] = 100.0  # as a large optimizer step would, with no forward since
    revived = snapshot(mlp)
    with mock.patch.object(quantization, "_attach_activations", side_effect=RuntimeError("injected failure")):
        with pytest.raises(RuntimeError, match="injected failure"):
            surgery.quantize(mlp, activations=A8, calibration=mlp_batches(), progress=False)
    assert snapshot_differences(revived, snapshot(mlp)) == []  # a failed call changes nothing, even here
    quantized = surgery.quantize(mlp, weights=GridSpec(symmetric=True), select="2", progress=False)
    reference = ao_observer(GridSpec(symmetric=True), None)
    reference(revived.tensors["param:2.weight"].masked_fill(~mask, 0))
    assert_qparams_equal(quantized.weights["2.weight"], reference)
    assert mlp[2].weight.detach()[mask].ne(0).any() and not mlp[2].weight.detach()[~mask].any()
    surgery.compose(pruned, quantized).restore()


def test_quantizing_the_same_layer_twice_raises_and_changes_nothing(mlp):
    first = surgery.quantize(mlp, select="2", progress=False)
    during = snapshot(mlp)
    for kwargs in ({"select": "2"}, {}, {"select": ["0", "2"], "weights": GridSpec(bits=4)}):
        with pytest.raises(surgery.AlreadyModifiedError, match=r"2\.weight"):
            surgery.quantize(mlp, progress=False, **kwargs)
        assert snapshot_differences(during, snapshot(mlp)) == []
    with surgery.quantize(mlp, select=["0", "4"], progress=False):  # nothing else was claimed
        pass
    first.restore()
    with surgery.quantize(mlp, select="2", progress=False):
        pass


def test_baking_releases_the_claim(mlp):
    surgery.quantize(mlp, progress=False).bake()
    baked = mlp[2].weight.detach().clone()
    with surgery.quantize(mlp, weights=GridSpec(bits=4, symmetric=True, per_channel=True), progress=False) as again:
        # attached again (not refused as already quantized): the weight moved onto its 4-bit grid
        quantizer = again.weights["2.weight"]
        assert quantizer.spec.bits == 4 and not torch.equal(mlp[2].weight, baked)
        on_grid = mlp[2].weight.detach().clone()
        quantizer.apply(on_grid)
        assert torch.equal(on_grid, mlp[2].weight)
    assert torch.equal(mlp[2].weight, baked)


# --- all-or-nothing: failures injected midway ---------------------------------------------------------


def _fail_on_call(number: int, real=None, error: BaseException | None = None):
    """A side effect that calls ``real`` (if given) and raises on the ``number``-th call."""
    calls = {"n": 0}

    def side_effect(*args, **kwargs):
        calls["n"] += 1
        result = real(*args, **kwargs) if real is not None else None
        if calls["n"] == number:
            raise error if error is not None else RuntimeError("injected failure")
        return result

    return side_effect


def _assert_untouched_and_usable(model, before, x, expected) -> None:
    assert snapshot_differences(before, snapshot(model)) == []
    assert hooks_on(model) == 0
    assert torch.equal(collect(model, [x])[0], expected)
    with surgery.quantize(model, activations=A8, calibration=[x], progress=False):  # nothing left claimed
        pass


@pytest.mark.parametrize("after_write", [False, True], ids=["before-writing", "after-writing"])
def test_failure_quantizing_the_third_weight_rolls_everything_back(mlp, mlp_input, after_write):
    before = snapshot(mlp)
    expected = collect(mlp, [mlp_input])[0]
    real = WeightQuantizer.apply if after_write else None
    with mock.patch.object(WeightQuantizer, "apply", autospec=True, side_effect=_fail_on_call(3, real)) as patched:
        with pytest.raises(RuntimeError, match="injected failure"):
            surgery.quantize(mlp, progress=False)
        assert patched.call_count == 3
    _assert_untouched_and_usable(mlp, before, mlp_input, expected)


def test_failure_attaching_activations_rolls_back_the_weights(convnet, image_input):
    before = snapshot(convnet)
    expected = collect(convnet, [image_input])[0]
    side_effect = _fail_on_call(1, quantization._attach_activations)
    with mock.patch.object(quantization, "_attach_activations", side_effect=side_effect) as patched:
        with pytest.raises(RuntimeError, match="injected failure"):
            surgery.quantize(convnet, activations=A8, calibration=image_batches(), progress=False)
        assert patched.call_count == 1
    _assert_untouched_and_usable(convnet, before, image_input, expected)


def test_failure_inside_a_calibration_forward_rolls_everything_back(convnet, image_input):
    convnet.train()
    before = snapshot(convnet)
    expected = collect(convnet, [image_input])[0]
    data = image_batches() + [torch.randn(2, 4, 12, 12)]  # wrong channel count: conv1 raises
    with pytest.raises(RuntimeError, match="channels"):
        surgery.quantize(convnet, activations=A8, calibration=data, progress=False)
    assert all(m.training for m in convnet.modules())
    _assert_untouched_and_usable(convnet, before, image_input, expected)


@pytest.mark.parametrize(
    ("method", "call"), [("__call__", 5), ("freeze", 2)], ids=["a calibration hook", "freezing the second layer"]
)
def test_failure_during_calibration_rolls_everything_back(mlp, mlp_input, method, call):
    before = snapshot(mlp)
    expected = collect(mlp, [mlp_input])[0]
    real = getattr(ActivationQuantizer, method)
    with mock.patch.object(ActivationQuantizer, method, autospec=True, side_effect=_fail_on_call(call, real)):
        with pytest.raises(RuntimeError, match="injected failure"):
            surgery.quantize(mlp, activations=A8, calibration=mlp_batches(), progress=False)
    _assert_untouched_and_usable(mlp, before, mlp_input, expected)


def test_keyboard_interrupt_during_calibration_rolls_back(mlp, mlp_input):
    before = snapshot(mlp)
    expected = collect(mlp, [mlp_input])[0]

    def interrupted() -> Iterator[torch.Tensor]:
        yield mlp_input
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        surgery.quantize(mlp, activations=A8, calibration=interrupted(), progress=False)
    _assert_untouched_and_usable(mlp, before, mlp_input, expected)


# --- a real architecture --------------------------------------------------------------------------------


def test_resnet18_w8a8_stays_close_to_float():
    """Random-init resnet18 at 64x64, int8 per-channel weights and int8 per-tensor activations on
    every conv and linear. Measured cosine ~0.9997 (SQNR ~33 dB); 0.99 leaves room for other
    seeds and torch versions. Random init has no trained outlier channels but also no tuned
    ranges, so only a loose bound is meaningful; a broken scale or axis gives far below 0.9."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torchvision.models.resnet18().eval()
        calibration = [torch.randn(4, 3, 64, 64) for _ in range(2)]
        inputs = torch.randn(4, 3, 64, 64)
    reference = copy.deepcopy(model)
    with surgery.quantize(model, weights=W8, activations=A8, calibration=calibration, progress=False) as handle:
        assert len(handle.weights) == 21 and len(handle.activations) == 21
        drift = surgery.compare(reference, model, inputs)
        assert drift.cosine > 0.99
        assert not drift.identical
    assert torch.equal(collect(model, [inputs])[0], collect(reference, [inputs])[0])
    assert hooks_on(model) == 0


@pytest.mark.parametrize(
    "spec",
    [GridSpec(bits=8), GridSpec(bits=8, symmetric=True), GridSpec(bits=3), GridSpec(bits=2, symmetric=True)],
    ids=["a8", "s8", "a3", "s2"],
)
def test_inference_fast_path_is_bit_identical_to_the_fused_op(spec):
    from surgery.ops.quantization.quantization import ActivationQuantizer

    torch.manual_seed(0)
    quantizer = ActivationQuantizer(spec, None, "layer", "output")
    quantizer.observer.observe(torch.randn(64) * 3)
    quantizer.freeze()
    scale = quantizer.scale
    x = torch.cat(
        [
            torch.randn(100_000) * 5,  # inside and outside the range
            (torch.arange(-300, 300) + 0.5) * scale,  # exact ties, rounded half to even
            torch.tensor([0.0, -0.0, 1e30, -1e30]),
        ]
    )
    with torch.no_grad():
        fast = quantizer._quantize(x)
    quant_min, quant_max = spec.quant_range
    fused = torch.fake_quantize_per_tensor_affine(x, scale, quantizer.zero_point, quant_min, quant_max)
    assert quantizer._fast_path(x) is not None
    assert torch.equal(fast, fused)
    needs_grad = x.clone().requires_grad_(True)
    assert quantizer._fast_path(needs_grad) is None  # training keeps the fused op's gradient
