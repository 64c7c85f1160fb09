"""One table of layer kinds: a new kind is one registration, and every consumer answers alike."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import surgery
from surgery.core.errors import ConfigError
from surgery.core.layer_kinds import LAYER_KINDS, LayerKind, kind_of, weight_axis_of
from surgery.core.targets import default_layer
from surgery.ops.equivalence.folding import _batch_norm
from surgery.ops.export.formats.onnx_qdq import onnx_layer
from surgery.ops.second_order.hessians import input_columns, supports_hessian
from surgery.ops.shrink.smaller import is_norm, rebuildable


class Dense(nn.Module):
    """A Linear-like layer torch does not know: ``x @ weight.T + bias``."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(outputs, inputs) / inputs**0.5)
        self.bias = nn.Parameter(torch.randn(outputs) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


def _smaller_dense(module: Dense, keep_in, keep_out, factory: dict) -> Dense:
    weight = module.weight.detach()
    weight = weight if keep_out is None else weight[keep_out]
    weight = weight if keep_in is None else weight[:, keep_in]
    new = Dense(weight.shape[1], weight.shape[0]).to(**factory)
    new.weight.copy_(weight)
    new.bias.copy_(module.bias if keep_out is None else module.bias[keep_out])
    return new


@pytest.fixture
def dense_kind():
    kind = LayerKind(
        "toy_dense",
        (Dense,),
        output_axis=0,
        input_axis=1,
        activation_axis=-1,
        default=True,
        hessian=True,
        describe=lambda m: {"inputs": m.weight.shape[1], "outputs": m.weight.shape[0]},
        smaller=_smaller_dense,
    )
    surgery.register_layer_kind(kind)
    yield kind
    LAYER_KINDS.unregister("toy_dense")


def _dense_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Dense(8, 16), nn.ReLU(), Dense(16, 4))


def test_a_registered_layer_kind_is_pruned_by_default(dense_kind):
    model = _dense_model()
    handle = surgery.prune(model, 0.5, progress=False)
    assert sorted(handle.selection.matched) == ["0.weight", "2.weight"]
    assert (model[0].weight == 0).float().mean().item() == pytest.approx(0.5)


def test_a_registered_layer_kind_is_quantized_per_channel_along_its_axis(dense_kind):
    model = _dense_model()
    x = torch.randn(3, 8)
    before = model(x)
    surgery.quantize(model, weights=surgery.GridSpec(bits=4, per_channel=True), progress=False)
    assert not torch.equal(model(x), before)
    assert model[0].weight.unique().numel() <= 16 * 16  # at most 2^4 levels per row


def test_a_registered_layer_kind_is_shrunk_and_rebuilt(dense_kind):
    model = _dense_model()
    handle = surgery.shrink(model, 0.5, calibration=torch.randn(2, 8))
    assert model[0].weight.shape == (8, 8) and model[2].weight.shape == (4, 8)
    recorded = json.loads(json.dumps(handle.structure()))
    assert recorded["0"]["args"] == {"inputs": 8, "outputs": 8}
    fresh = surgery.rebuild(_dense_model, recorded, meta=False)
    assert fresh[0].weight.shape == (8, 8)
    fresh.load_state_dict(handle.bake().state_dict(), strict=True)
    x = torch.randn(2, 8)
    assert torch.equal(fresh(x), model(x))


def test_without_its_registration_a_custom_layer_is_left_alone():
    model = _dense_model()
    assert kind_of(model[0]) is None and not default_layer(model[0]) and not rebuildable(Dense)
    with pytest.raises(ConfigError):
        surgery.prune(model, 0.5, progress=False)  # nothing in the default selection


def test_conv3d_is_answered_once_by_each_consumer():
    conv3d, conv2d = nn.Conv3d(2, 4, 3), nn.Conv2d(2, 4, 3)
    assert weight_axis_of(conv3d) == weight_axis_of(conv2d) == 0
    assert default_layer(conv3d) and rebuildable(nn.Conv3d) and onnx_layer(conv3d)
    assert not supports_hessian(conv3d)  # F.unfold is 2-d: refused in one line
    with pytest.raises(ConfigError, match="second-order methods need a layer kind they can unfold"):
        input_columns(conv3d, "c", torch.randn(1, 2, 4, 4, 4))


def test_sync_batchnorm_is_a_batchnorm_for_every_consumer():
    sync, plain = nn.SyncBatchNorm(4), nn.BatchNorm2d(4)
    assert kind_of(sync) is kind_of(plain)
    for consumer in (is_norm, _batch_norm, lambda m: rebuildable(type(m))):
        assert consumer(sync) and consumer(plain)


def test_a_transposed_convolution_holds_outputs_on_axis_one_and_is_not_rebuilt():
    transposed = nn.ConvTranspose2d(2, 4, 3)
    assert weight_axis_of(transposed) == 1
    assert not rebuildable(nn.ConvTranspose2d) and not onnx_layer(transposed) and not default_layer(transposed)


def test_shrink_removes_channels_of_a_conv3d():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(2, 8, 3, padding=1), nn.ReLU(), nn.Conv3d(8, 3, 3, padding=1)).eval()
    surgery.shrink(model, 0.5, calibration=torch.randn(1, 2, 4, 4, 4))
    assert model[0].out_channels == 4 and model[2].in_channels == 4


def test_shrink_rebuilds_a_sync_batchnorm_and_an_rms_norm_smaller():
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(2, 8, 3), nn.SyncBatchNorm(8), nn.ReLU(), nn.Conv2d(8, 2, 1)).eval()
    surgery.shrink(conv, 0.5, calibration=torch.randn(1, 2, 6, 6))
    assert isinstance(conv[1], nn.SyncBatchNorm) and conv[1].num_features == 4
    dense = nn.Sequential(nn.Linear(4, 8), nn.RMSNorm(8), nn.Linear(8, 2)).eval()
    surgery.shrink(dense, 0.5, calibration=torch.randn(2, 4))
    assert isinstance(dense[1], nn.RMSNorm) and dense[1].normalized_shape == (4,)


def test_a_layer_kind_with_an_unknown_normalisation_is_refused():
    with pytest.raises(ConfigError, match="normalises"):
        LayerKind("bad", (nn.Linear,), normalises="sometimes")
