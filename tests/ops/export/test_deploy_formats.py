"""Deployment formats: each export is loaded by its own runtime (transformers with
compressed-tensors, ONNX Runtime, torchao) and compared with the model under surgery."""

from __future__ import annotations

import collections
import dataclasses
import json
from unittest import mock

import numpy as np
import pytest
import torch
import torchvision
from safetensors import safe_open
from support import NormAct, tiny_llama, trained_stats  # tests/support.py
from torch import nn

import surgery
from surgery.core.errors import ConfigError, OutputExistsError

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("torchao")


def kernels_formed(path, folder) -> collections.Counter:
    """The op types of the graph ONNX Runtime runs, after its fusions (int8 kernels formed)."""
    import onnx

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(str(folder / "optimized.onnx")).graph.node)


def mlp(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)]
    return nn.Sequential(*layers).eval()


def fp32_bytes(model: nn.Module) -> int:
    return sum(t.numel() * 4 for t in model.state_dict().values())


@pytest.mark.parametrize(
    "weights",
    [
        {"bits": 4, "symmetric": True, "per_channel": True, "group_size": 32},
        {"bits": 4, "symmetric": False, "per_channel": True, "group_size": 32},
        {"bits": 8, "symmetric": True, "per_channel": True},
    ],
    ids=["w4_g32_sym", "w4_g32_asym", "w8_channel"],
)
def test_compressed_tensors_folders_load_in_transformers_with_logits_equal_to_the_simulation(tmp_path, weights):
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 16))
    spec = surgery.QuantizeSpec(weights=surgery.GridSpec(**weights), select="**.*_proj")
    with surgery.quantize(model, spec) as handle:
        expected = model(ids).logits
        record = surgery.export(handle, tmp_path / "llama", format="compressed-tensors", inputs=[ids])
    assert record.parity.equal and record.parity.expected == "exact" and record.parity.holds
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama", local_files_only=True).eval()
    assert torch.equal(loaded(ids).logits, expected)
    assert record.bytes < 0.7 * fp32_bytes(model)  # the embeddings and lm_head stay float
    with safe_open(str(tmp_path / "llama" / "model.safetensors"), "pt") as file:
        packed = [k for k in list(file.keys()) if k.endswith("weight_packed")]
    assert len(packed) == 14  # 7 projections in each of 2 layers


@pytest.mark.parametrize(
    "weights",
    [{"bits": 4, "symmetric": True, "group_size": 32}, {"bits": 8, "symmetric": False, "per_channel": True}],
    ids=["w4_g32_sym", "w8_channel_asym"],
)
def test_bfloat16_weight_only_compressed_tensors_equal_the_simulation_bit_for_bit(tmp_path, weights):
    """A bfloat16 weight's scale is stored in bfloat16 (compressed-tensors' weight_scale): both
    compute (q - zero point) x scale exactly, then round once to bfloat16."""
    model = tiny_llama(dtype=torch.bfloat16)
    rotary = model.model.rotary_emb  # as transformers loads a bfloat16 folder: these stay float32
    for name, buffer in list(rotary.named_buffers()):
        setattr(rotary, name, buffer.float() if name != "inv_freq" else tiny_llama(layers=1).model.rotary_emb.inv_freq)
    rotary.original_inv_freq = rotary.inv_freq.clone()
    ids = torch.randint(0, 128, (2, 16))
    spec = surgery.QuantizeSpec(weights=surgery.GridSpec(**weights), select="**.*_proj")
    with surgery.quantize(model, spec) as handle:
        record = surgery.export(handle, tmp_path / "llama", format="compressed-tensors", inputs=[ids])
    assert record.parity.equal and record.parity.holds, record.parity


@pytest.mark.parametrize(
    ("weights", "inputs"),
    [({"per_channel": True}, False), ({"group_size": 32}, False), ({}, True)],
    ids=["fp8_channel", "fp8_block32", "fp8_w8a8_static"],
)
def test_fp8_compressed_tensors_folders_hold_float8_weights_with_logits_equal_to_the_simulation(
    tmp_path, weights, inputs
):
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 16))
    activations = surgery.GridSpec(format="fp8_e4m3") if inputs else None
    spec = surgery.QuantizeSpec(
        weights=surgery.GridSpec(format="fp8_e4m3", **weights),
        activations=activations,
        where="input",
        select="**.*_proj",
    )
    with surgery.quantize(model, spec, calibration=[ids] if inputs else None) as handle:
        expected = model(ids).logits
        record = surgery.export(handle, tmp_path / "llama", format="compressed-tensors", inputs=[ids])
    assert record.parity.equal and record.parity.expected == "exact" and record.parity.holds
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama", local_files_only=True).eval()
    assert torch.equal(loaded(ids).logits, expected)
    with safe_open(str(tmp_path / "llama" / "model.safetensors"), "pt") as file:
        weight = file.get_tensor("model.layers.0.mlp.up_proj.weight")
        names = set(file.keys())
    assert weight.dtype == torch.float8_e4m3fn and ("model.layers.0.mlp.up_proj.input_scale" in names) == inputs


@pytest.mark.parametrize("fmt, layout", [("mxfp4", "mxfp4-pack-quantized"), ("nvfp4", "nvfp4-pack-quantized")])
def test_fp4_compressed_tensors_folders_pack_two_weights_a_byte_and_load_with_our_weights(tmp_path, fmt, layout):
    model = tiny_llama().to(torch.bfloat16)  # compressed-tensors unpacks FP4 to bfloat16
    ids = torch.randint(0, 128, (2, 16))
    with surgery.quantize(model, weights=surgery.GridSpec(format=fmt), select="**.*_proj") as handle:
        ours = model.model.layers[0].mlp.up_proj.weight.detach().clone()
        record = surgery.export(handle, tmp_path / "llama", format="compressed-tensors", inputs=[ids])
    # the runtime's weights are ours; its logits differ in bfloat16 rounding elsewhere (measured cosine 0.999995)
    assert record.parity.expected == "cosine>=0.9999" and record.parity.holds, record.parity
    loaded = record.load()
    assert not hasattr(loaded.model.layers[0].mlp.up_proj, "weight")  # held packed until its first forward
    loaded(ids)
    assert torch.equal(loaded.model.layers[0].mlp.up_proj.weight, ours)
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["quantization_config"]["format"] == layout
    with safe_open(str(tmp_path / "llama" / "model.safetensors"), "pt") as file:
        packed = file.get_tensor("model.layers.0.mlp.up_proj.weight_packed")
        scale = file.get_tensor("model.layers.0.mlp.up_proj.weight_scale")
    assert packed.dtype == torch.uint8 and packed.shape == (ours.shape[0], ours.shape[1] // 2)
    assert scale.dtype == (torch.uint8 if fmt == "mxfp4" else torch.float8_e4m3fn)


def test_float_formats_compressed_tensors_does_not_hold_are_one_line(tmp_path):
    model = tiny_llama()
    with surgery.quantize(model, weights=surgery.GridSpec(format="fp8_e5m2"), select="**.*_proj") as handle:
        with pytest.raises(
            ConfigError, match=r"quantize.weights.format='fp8_e5m2': surgery writes these floating-point weights"
        ):
            surgery.export(handle, tmp_path / "llama", format="compressed-tensors")
    with surgery.quantize(model, weights=surgery.GridSpec(format="nvfp4"), select="**.*_proj") as handle:
        with pytest.raises(ConfigError, match=r"^quantize.weights.format='nvfp4': .* is torch.float32; compressed"):
            surgery.export(handle, tmp_path / "llama", format="compressed-tensors")
    assert not (tmp_path / "llama").exists()


def test_compressed_tensors_w8a8_static_inputs_stay_within_the_bound(tmp_path):
    model = tiny_llama()
    calibration = [torch.randint(0, 128, (2, 16)) for _ in range(3)]
    spec = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8, symmetric=True), target="compressed-tensors")
    with surgery.quantize(model, spec, calibration=calibration) as handle:
        record = surgery.export(handle, tmp_path / "w8a8", format="compressed-tensors", inputs=calibration[:1])
    assert record.parity.expected == "cosine>=0.9999" and record.parity.holds, record.parity
    with safe_open(str(tmp_path / "w8a8" / "model.safetensors"), "pt") as file:
        assert "model.layers.0.self_attn.q_proj.input_scale" in list(file.keys())


def test_compressed_tensors_w8a8_dynamic_quantizes_each_token_at_load(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 16))
    spec = surgery.QuantizeSpec(weights=surgery.GridSpec(bits=8, symmetric=True, per_channel=True), select="**.*_proj")
    with surgery.quantize(model, spec) as handle:
        record = surgery.export(
            handle, tmp_path / "llama", format="compressed-tensors", inputs=[ids], activations="dynamic"
        )
        with pytest.raises(ConfigError, match=r"^export.options.activations='per-layer': must be one of static, dyn"):
            surgery.export(handle, tmp_path / "bad", format="compressed-tensors", activations="per-layer")
        with pytest.raises(ConfigError, match=r"^export.options.activations='static': needs activations quantized"):
            surgery.export(handle, tmp_path / "bad", format="compressed-tensors", activations="static")
    assert record.parity.holds and not record.parity.equal, record.parity  # within 0.9999: tokens rounded
    scheme = record.load().model.layers[0].self_attn.q_proj.quantization_scheme.input_activations
    assert scheme.dynamic is True and scheme.strategy == "token"
    with safe_open(str(tmp_path / "llama" / "model.safetensors"), "pt") as f:
        assert not any(key.endswith("input_scale") for key in f.keys())  # noqa: SIM118 - safe_open is not iterable
    assert not (tmp_path / "bad").exists()


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("bits", [8, 4])
def test_gpt2_conv1d_weights_keep_their_layout_and_load_with_equal_logits(tmp_path, bits):
    model = gpt2()
    ids = torch.randint(0, 128, (2, 16))
    spec = surgery.QuantizeSpec(weights=surgery.GridSpec(bits=bits, symmetric=True, per_channel=True))
    with surgery.quantize(model, spec) as handle:  # lm_head is tied to the embedding: left out
        expected = model(ids).logits
        record = surgery.export(handle, tmp_path / "gpt2", format="compressed-tensors", inputs=[ids])
    assert record.parity.equal, record.parity
    with safe_open(str(tmp_path / "gpt2" / "model.safetensors"), "pt") as f:
        # c_attn is (64 inputs, 192 outputs): one scale per output column, its packed rows the inputs
        assert f.get_tensor("transformer.h.0.attn.c_attn.weight_scale").shape == (1, 192)
        assert f.get_tensor("transformer.h.0.attn.c_attn.weight_shape").tolist() == [64, 192]
    loaded = record.load()
    assert torch.equal(loaded(ids).logits, expected)
    assert type(loaded.transformer.h[0].attn.c_attn).__name__ == "Conv1D"


@pytest.mark.parametrize(
    "weights",
    [{"bits": 8, "per_channel": False}, {"bits": 4, "per_channel": False}, {"format": "fp8_e4m3", "per_channel": True}],
)
def test_gpt2_conv1d_weights_of_every_grid_load_in_their_own_layout(tmp_path, weights):
    model = gpt2()  # c_attn is (64 inputs, 192 outputs): a per-tensor grid lays it out as rows of outputs too
    ids = torch.randint(0, 128, (2, 16))
    with surgery.quantize(model, surgery.QuantizeSpec(weights=surgery.GridSpec(symmetric=True, **weights))) as handle:
        record = surgery.export(handle, tmp_path / "gpt2", format="compressed-tensors", inputs=[ids])
        weight = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    assert record.parity.equal, record.parity
    assert torch.equal(record.load().transformer.h[0].attn.c_attn.weight.float(), weight)


def test_gpt2_conv1d_settings_compressed_tensors_cannot_hold_are_one_line(tmp_path):
    model = gpt2()
    ids = torch.randint(0, 128, (2, 16))
    for weights, activations, message in (
        ({"group_size": 32}, None, r"^quantize.weights='group_size=32': transformer.h.0.attn.c_attn is a Conv1D"),
        ({"symmetric": False}, None, r"^quantize.weights='symmetric=False': .* quantize Conv1D layers symmetric"),
        ({}, surgery.GridSpec(bits=8), r"^quantize.activations='.*': transformers loads compressed-tensors"),
    ):
        spec = surgery.QuantizeSpec(
            weights=surgery.GridSpec(**{"bits": 4, "symmetric": True, "per_channel": True, **weights}),
            activations=activations,
            where="input",
        )
        with surgery.quantize(model, spec, calibration=[ids] if activations else None) as handle:
            with pytest.raises(ConfigError, match=message):
                surgery.export(handle, tmp_path / "gpt2", format="compressed-tensors")
    assert list(tmp_path.iterdir()) == []


def test_onnx_export_forms_int8_kernels_and_keeps_the_simulated_outputs(tmp_path):
    model = mlp(256)
    calibration = [torch.randn(16, 64) for _ in range(4)]
    spec = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8), target="onnx")
    with surgery.quantize(model, spec, calibration=calibration) as handle:
        record = surgery.export(handle, tmp_path / "mlp.onnx", format="onnx", inputs=calibration[:2])
    assert record.parity.expected == "cosine>=0.999" and record.parity.holds, record.parity
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(record.path), options, providers=["CPUExecutionProvider"])
    import onnx

    kinds = collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)
    assert kinds["QGemm"] == 3 and kinds["Gemm"] == 0, kinds  # every Linear runs as an int8 kernel
    assert record.bytes < 0.35 * fp32_bytes(model)


def test_onnx_weights_are_held_as_uint8_about_128_for_kernels_that_never_saturate(tmp_path):
    """ONNX Runtime's u8s8 int8 kernels add pairs of products in int16 on x86 CPUs without VNNI
    (AVX2): the same export with int8 weights drifted 20 steps from the simulation on such a CPU.
    Held as uint8 with zero point 128 (the same values), it runs on u8u8 kernels, exact anywhere."""
    import onnx
    from onnx import numpy_helper

    model = mlp(256)
    calibration = [torch.randn(16, 64) for _ in range(4)]
    spec = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8), target="onnx")
    with surgery.quantize(model, spec, calibration=calibration) as handle:
        record = surgery.export(handle, tmp_path / "mlp.onnx", format="onnx", inputs=calibration[:2])
        step = min(float(a.scale.min()) for a in handle.activations.values())
    assert record.parity.max_abs <= 1.01 * max(float(a.scale.max()) for a in handle.activations.values())
    graph = onnx.load(str(record.path)).graph
    constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    weights = [name for name in constants if "weight_int8" in name]
    zeros = [name for name in constants if "weight_zero_point" in name]
    assert len(weights) == len(zeros) == 3 and step > 0
    assert all(constants[name].dtype == np.uint8 for name in weights)
    assert all(constants[name].dtype == np.uint8 and (constants[name] == 128).all() for name in zeros)


def test_onnx_weights_int8_writes_onnx_runtime_s_own_layout_and_says_what_it_costs_where_it_drifts(tmp_path):
    """``weights="int8"``: zero point 0, int8 integers (ONNX Runtime's own quantizer's layout, its
    u8s8 kernels: fastest, exact with VNNI). Where it drifts (x86 without VNNI), the parity error
    says why and names the default; a value outside the two is one line."""
    import onnx
    from onnx import numpy_helper

    model = mlp(256)
    calibration = [torch.randn(16, 64) for _ in range(4)]
    spec = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8), target="onnx")
    with surgery.quantize(model, spec, calibration=calibration) as handle:
        default = surgery.export(handle, tmp_path / "uint8.onnx", format="onnx", inputs=calibration[:2])
        unchecked = surgery.export(
            handle, tmp_path / "int8.onnx", format="onnx", inputs=calibration[:2], weights="int8", compare=False
        )
        try:
            checked = surgery.export(
                handle, tmp_path / "checked.onnx", format="onnx", inputs=calibration[:2], weights="int8"
            )
        except surgery.ExportParityError as err:  # this CPU's u8s8 kernels drift
            assert "with weights='int8' ONNX Runtime runs its u8s8 kernels" in str(err) and "weights='uint8'" in str(
                err
            )
            assert not (tmp_path / "checked.onnx").exists()
        else:
            assert checked.parity.holds
        with pytest.raises(ConfigError, match=r"^export\.options\.weights='int4': must be uint8 or int8$"):
            surgery.export(handle, tmp_path / "int4.onnx", format="onnx", inputs=calibration[:2], weights="int4")
    constants = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(unchecked.path)).graph.initializer}
    weights = sorted(name for name in constants if "weight_int8" in name)
    zeros = [name for name in constants if "weight_zero_point" in name]
    assert len(weights) == len(zeros) == 3
    assert all(constants[name].dtype == np.int8 for name in weights)
    assert all(constants[name].dtype == np.int8 and (constants[name] == 0).all() for name in zeros)
    held = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(default.path)).graph.initializer}
    for name in weights:  # the same values either way
        assert np.array_equal(held[name].astype(np.int16) - 128, constants[name].astype(np.int16))
    assert unchecked.int8_ops == default.int8_ops


def test_onnx_export_prints_the_exporters_steps_only_when_surgery_logs_debug(tmp_path, capsys):
    """Quiet by default; ``hydra.verbose=surgery`` (the ``surgery`` logger at DEBUG) shows them."""
    import logging

    model, x = mlp(16), torch.randn(4, 64)
    with surgery.quantize(model, weights=surgery.GridSpec(bits=8, symmetric=True, per_channel=True)) as handle:
        surgery.export(handle, tmp_path / "quiet.onnx", format="onnx", inputs=[x])
        assert "[torch.onnx]" not in capsys.readouterr().out
        logger = logging.getLogger("surgery")
        level = logger.level
        logger.setLevel(logging.DEBUG)
        try:
            surgery.export(handle, tmp_path / "verbose.onnx", format="onnx", inputs=[x])
        finally:
            logger.setLevel(level)
        assert "[torch.onnx]" in capsys.readouterr().out


def test_target_onnx_folds_batchnorm_restorably_and_the_export_matches(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.LazyLinear(4)
    )
    calibration = [torch.randn(2, 3, 12, 12) for _ in range(3)]
    model(calibration[0])
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    expected = model(calibration[0])
    spec = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8), target="onnx")
    with surgery.quantize(model, spec, calibration=calibration) as handle:
        assert isinstance(model[1], nn.Identity) and model[0].bias is not None
        record = surgery.export(handle, tmp_path / "cnn.onnx", format="onnx", inputs=calibration)
        assert record.parity.holds, record.parity
    assert isinstance(model[1], nn.BatchNorm2d)
    assert (
        all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        and before.keys() == model.state_dict().keys()
    )
    assert torch.equal(model(calibration[0]), expected)


class Residual(nn.Module):
    """A ResNet basic block's shape: the second convolution's output meets the skip in an Add."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.conv1, self.bn1 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))
        return self.head(x.mean((2, 3)))


def test_target_onnx_puts_every_convolution_of_a_residual_block_on_an_int8_kernel(tmp_path):
    torch.manual_seed(0)
    model = Residual().eval()
    calibration = [torch.randn(2, 3, 10, 10) for _ in range(3)]
    spec = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8), target="onnx")
    with surgery.quantize(model, spec, calibration=calibration) as handle:
        assert set(handle.qparams()) >= {"conv2.scale", "conv2@output.scale", "head@output.scale"}
        record = surgery.export(handle, tmp_path / "block.onnx", format="onnx", inputs=calibration)
        assert record.parity.holds, record.parity
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(str(record.path), options, providers=["CPUExecutionProvider"])
    import onnx

    kinds = collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)
    # conv2 feeds the residual Add: without its own output quantizer it stayed a float Conv
    assert kinds["QLinearConv"] == 3 and kinds["Conv"] == 0 and kinds["QGemm"] == 1, kinds
    assert [o.name for o in session.get_outputs()] == [o.name for o in onnx.load(str(record.path)).graph.output]


def test_where_both_quantizes_inputs_and_outputs_and_reloads_from_saved_parameters(tmp_path):
    model = mlp()
    calibration = [torch.randn(8, 64) for _ in range(3)]
    x = torch.randn(4, 64)
    with surgery.quantize(model, activations=surgery.GridSpec(bits=8), where="both", calibration=calibration) as h:
        assert set(h.activations) == {"0", "0@output", "2", "2@output", "4", "4@output"}
        expected = model(x)
        h.save_qparams(tmp_path / "q.safetensors")
        h.bake()
    with surgery.quantize(
        model, weights=None, activations=surgery.GridSpec(bits=8), where="both", qparams=tmp_path / "q.safetensors"
    ):
        assert torch.equal(model(x), expected)
    outputs_only = mlp()
    with surgery.quantize(outputs_only, activations=surgery.GridSpec(bits=8), calibration=calibration):
        assert not torch.equal(outputs_only(x), expected)  # the inputs' quantizers change the result


def test_onnx_refuses_weights_left_before_an_unfolded_batchnorm(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    x = torch.randn(1, 3, 8, 8)
    with surgery.quantize(model) as handle:
        with pytest.raises(ConfigError, match=r"^export.handle='0 feeds BatchNorm 1': .*quantize with target='onnx'$"):
            surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=x)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("activations", ["none", "dynamic", "static"])
def test_torchao_int8_tensors_are_built_from_our_scales(tmp_path, activations):
    model = mlp()
    calibration = [torch.randn(16, 64) for _ in range(3)]
    quantized = surgery.GridSpec(bits=8) if activations == "static" else None
    spec = surgery.QuantizeSpec(activations=quantized, target="torchao")
    with surgery.quantize(model, spec, calibration=calibration if quantized else None) as handle:
        scales = handle.weight_qparams()
        record = surgery.export(
            handle, tmp_path / "m.pt", format="torchao", inputs=calibration[:2], activations=activations
        )
    assert record.parity.holds, record.parity
    loaded = record.load()
    from torchao.quantization import Int8Tensor

    assert isinstance(loaded[0].weight, Int8Tensor)
    assert torch.equal(loaded[0].weight.scale.reshape(-1), scales["0.weight.scale"])


def test_torchao_dynamic_inputs_round_as_torchao_does_and_a_gemma2_keeps_the_bound(tmp_path):
    from torchao.quantization import Int8Tensor, PerRow

    from surgery.ops.numerics.fake_quant import fake_quantize_dynamic

    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        sliding_window=8,
    )  # fmt: skip  (a window the 16-token check exercises: a longer one it could not vouch for)
    model = transformers.Gemma2ForCausalLM(config).eval()
    ids = torch.randint(0, 128, (2, 16))
    dynamic = surgery.GridSpec(bits=8, symmetric=True, dynamic="token")
    spec = surgery.QuantizeSpec(weights=surgery.GridSpec(bits=8, symmetric=True, per_channel=True),
                                activations=dynamic, target="torchao")  # fmt: skip
    with surgery.quantize(model, spec) as handle:
        rounding = {q.spec.rounding for q in handle.activations.values()}
        record = surgery.export(handle, tmp_path / "gemma2.pt", format="torchao", inputs=[ids])
    assert rounding == {"reciprocal"} and record.parity.holds, record.parity  # 0.99982 when rounding x / scale
    x = torch.randn(256, 64)
    simulated = fake_quantize_dynamic(x, dataclasses.replace(dynamic, rounding="reciprocal"))[0]
    assert torch.equal(simulated, Int8Tensor.from_hp(x, PerRow()).dequantize())


def test_torchao_static_activations_take_inputs_of_any_rank(tmp_path):
    model = mlp()
    calibration = [torch.randn(2, 5, 64) for _ in range(3)]  # (batch, tokens, features), as a decoder's
    spec = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8), target="torchao")
    with surgery.quantize(model, spec, calibration=calibration) as handle:
        record = surgery.export(handle, tmp_path / "m.pt", format="torchao", inputs=calibration[:2])
    assert record.parity.holds, record.parity
    assert record.load()(calibration[0]).shape == (2, 5, 10)


def test_torchao_int4_on_cpu_is_one_line(tmp_path):
    model = mlp()
    with surgery.quantize(model, weights=surgery.GridSpec(bits=4, symmetric=True, per_channel=True)) as handle:
        with pytest.raises(
            ConfigError, match=r"^quantize.weights.bits=4: torchao .* has no int4 CPU kernel for float32 models"
        ):
            surgery.export(handle, tmp_path / "m.pt", format="torchao")
    assert list(tmp_path.iterdir()) == []


def test_weight_qparams_are_public_and_saved_with_the_activation_parameters(tmp_path):
    model = mlp()
    calibration = [torch.randn(8, 64)]
    with surgery.quantize(
        model, weights=surgery.GridSpec(bits=4, symmetric=True, group_size=16), activations=surgery.GridSpec(bits=8),
        calibration=calibration,
    ) as handle:  # fmt: skip
        weights = handle.weight_qparams()
        assert weights["0.weight.scale"].shape == (64, 4)
        path = handle.save_qparams(tmp_path / "q.safetensors")
    with safe_open(str(path), "pt") as file:
        keys = set(file.keys())
    assert {"0.weight.scale", "0.weight.zero_point", "0.scale", "0.zero_point"} <= keys


def test_bad_deployment_exports_are_one_line_and_write_nothing(tmp_path):
    model = mlp()
    x = torch.randn(4, 64)
    with surgery.prune(model, 0.5) as pruned:
        with pytest.raises(ConfigError, match=r"^export.handle='nothing quantized': format='onnx' holds"):
            surgery.export(pruned, tmp_path / "m.onnx", format="onnx", inputs=x)
    with surgery.rewrite_inputs(model, lambda args, kwargs: ((args[0] * 2,), kwargs)) as rewritten:
        with pytest.raises(ConfigError, match=r"cannot be expressed in format='torchao'$"):
            surgery.export(rewritten, tmp_path / "m.pt", format="torchao")
    with surgery.quantize(model) as handle:
        with pytest.raises(ConfigError, match=r"^export.format='compressed-tensors': writes a Hugging Face folder"):
            surgery.export(handle, tmp_path / "ct", format="compressed-tensors")
        with pytest.raises(ConfigError, match=r"^export.inputs=None: format='onnx' traces the model"):
            surgery.export(handle, tmp_path / "m.onnx", format="onnx")
    with surgery.quantize(model, weights=surgery.GridSpec(bits=4, symmetric=True)) as handle:
        with pytest.raises(ConfigError, match=r"^quantize.weights='0.weight: 4-bit symmetric': ONNX Runtime"):
            surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=x)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match=r"^quantize.target='safetensors': has no deployment rules; one of"):
        surgery.QuantizeSpec(target="safetensors")
    with pytest.raises(
        ConfigError,
        match=r"^quantize.target=.onnxx.: has no deployment rules; one of compressed-tensors, fp8, gguf:Q3_K, .*, onnx",
    ):
        surgery.QuantizeSpec(target="onnxx")


def test_a_failed_folder_export_leaves_the_earlier_folder_as_it_was(tmp_path):
    model = tiny_llama()
    target = tmp_path / "llama"
    target.mkdir()
    (target / "keep.txt").write_text("earlier")
    with surgery.quantize(model, weights=surgery.GridSpec(bits=8, symmetric=True, group_size=48)) as handle:
        with pytest.raises(ConfigError, match=r"^quantize.weights.group_size=48: does not divide"):
            surgery.export(handle, target, format="compressed-tensors", overwrite=True)
        with pytest.raises(OutputExistsError):
            surgery.export(handle, target, format="compressed-tensors")
    assert [p.name for p in tmp_path.iterdir()] == ["llama"] and (target / "keep.txt").read_text() == "earlier"


def test_a_timm_resnet_exports_to_onnx_with_every_convolution_on_an_int8_kernel(tmp_path):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet10t").eval()  # a stem of three convolutions, then basic blocks
    calibration = [torch.randn(2, 3, 64, 64) for _ in range(3)]
    spec = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8), target="onnx")
    with surgery.quantize(model, spec, calibration=calibration) as handle:
        record = surgery.export(handle, tmp_path / "resnet10t.onnx", format="onnx", inputs=calibration[:1])
    assert record.parity.holds, record.parity
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(record.path), options, providers=["CPUExecutionProvider"])
    import onnx

    kinds = collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)
    convolutions = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    assert kinds["QLinearConv"] == convolutions and kinds["Conv"] == 0, kinds


def test_a_torchvision_resnet_runs_on_int8_kernels_end_to_end_as_onnx_runtime_quantizes_it(tmp_path):
    torch.manual_seed(0)
    model = torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=10).eval()
    generator = torch.Generator().manual_seed(1)
    calibration = [torch.randn(2, 3, 32, 32, generator=generator) for _ in range(3)]
    spec = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8), target="onnx")
    with surgery.quantize(model, spec, calibration=calibration) as handle:
        record = surgery.export(handle, tmp_path / "resnet.onnx", format="onnx", inputs=calibration)
        assert record.parity.holds, record.parity
    kinds = kernels_formed(record.path, tmp_path)
    convolutions = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    assert kinds["QLinearConv"] == convolutions and kinds["Conv"] == 0 and kinds["QGemm"] == 1, kinds
    # each ReLU folds into the quantizer after it; the residual additions of the first three
    # blocks run as int8 (the last block's feeds the float average pool, as in ONNX Runtime's own flow)
    assert kinds["QLinearAdd"] == 3 and kinds["Add"] == 1 and kinds["Relu"] <= 1, kinds


def test_a_functional_relu_between_layers_folds_into_the_next_layers_input_quantizer(tmp_path):
    from surgery.tasks.mnist1d import MNIST1DCNN  # conv -> F.relu -> conv: no module to hook at the ReLU

    torch.manual_seed(0)
    model = MNIST1DCNN().eval()
    calibration = [torch.randn(8, 40) for _ in range(3)]
    spec = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8), target="onnx")
    with surgery.quantize(model, spec, calibration=calibration) as handle:
        # rounded once, after the ReLU (by the reader's input quantizer), as ONNX Runtime rounds
        assert not {"conv1@output", "conv2@output", "fc1@output"} & set(handle.activations)
        assert "conv3@output" in handle.activations  # its ReLU feeds a flatten, not a layer: no fusion there
        record = surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=calibration)
        assert record.parity.holds, record.parity
    kinds = kernels_formed(record.path, tmp_path)
    assert kinds["QLinearConv"] == 3 and kinds["QGemm"] == 2 and kinds["Conv"] == 0 and kinds["Relu"] == 0, kinds


def test_a_batchnorm_subclass_folded_exports_with_its_activation(tmp_path):
    torch.manual_seed(0)
    model = trained_stats(nn.Sequential(nn.Conv2d(3, 8, 3), NormAct(8), nn.Conv2d(8, 4, 3)))
    calibration = [torch.randn(2, 3, 12, 12) for _ in range(3)]
    spec = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8), target="onnx")
    with surgery.quantize(model, spec, calibration=calibration) as handle:
        record = surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=calibration)
        assert record.parity.holds, record.parity


class ConvsAndTokens(nn.Module):
    """Bias-less convolutions around a BatchNorm subclass and a Concat, and a Linear over the
    pixels as tokens (a MatMul of its transposed weight), as in densenet, mixnet and mobilevit."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.fc = nn.Conv2d(3, 8, 3, padding=1, bias=False), NormAct(8), nn.Linear(8, 8)
        self.side, self.head = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.Conv2d(16, 4, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.conv(x))
        tokens = self.fc(y.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(y.shape)
        return self.head(torch.cat([tokens, self.side(x)], 1))


def test_onnx_after_a_batchnorm_subclass_runs_every_layer_in_int8_and_keeps_no_float_weight(tmp_path):
    torch.manual_seed(0)
    model = trained_stats(ConvsAndTokens())
    model.fc.bias.data += 2.0  # quantized before its bias, the Linear's output would clip
    calibration = [torch.randn(2, 3, 8, 8) for _ in range(3)]
    spec = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8), target="onnx")
    with surgery.quantize(model, spec, calibration=calibration) as handle:
        record = surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=calibration)
        assert record.parity.holds, record.parity
    assert record.int8_ops == (4, 4) and record.as_dict()["int8_ops"] == [4, 4]
    kinds = kernels_formed(record.path, tmp_path)
    assert kinds["QLinearConv"] == 3 and kinds["Conv"] == 0, kinds
    # the Linear's output is quantized after its bias Add, as simulated: int8 MatMul, float bias
    assert kinds["MatMulIntegerToFloat"] == 1 and kinds["QLinearMatMul"] == 0, kinds
    import onnx

    floats = [i.name for i in onnx.load(str(record.path)).graph.initializer if i.data_type == 1 and len(i.dims) > 1]
    assert floats == []  # no float copy of a weight (the exporter read a bias-less weight's shape from one)


def test_onnx_counts_the_weighted_ops_left_in_float_and_says_so(tmp_path, caplog):
    torch.manual_seed(0)
    model = trained_stats(ConvsAndTokens())
    calibration = [torch.randn(2, 3, 8, 8) for _ in range(3)]
    spec = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8), target="onnx")
    excluding = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8), exclude="side", target="onnx")
    with surgery.quantize(model, excluding, calibration=calibration) as handle:
        with caplog.at_level("WARNING", logger="surgery"):
            record = surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=calibration[:1])
    assert record.int8_ops == (3, 4) and not any("int8 kernels" in r.message for r in caplog.records)
    with surgery.quantize(model, spec, calibration=calibration) as handle:
        with mock.patch("surgery.ops.export.formats.onnx_qdq.count_int8_ops", return_value=(2, 4)):
            with caplog.at_level("WARNING", logger="surgery"):
                record = surgery.export(handle, tmp_path / "n.onnx", format="onnx", inputs=calibration[:1])
    assert record.int8_ops == (2, 4)
    assert "ONNX Runtime runs 2 of the 4 quantized layers on int8 kernels (4 weighted ops in all)" in caplog.text


def test_onnx_refuses_a_weight_the_graph_computes_naming_the_exclusion(tmp_path):
    torch.manual_seed(0)
    model = trained_stats(ConvsAndTokens())
    calibration = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    spec = surgery.QuantizeSpec(activations=surgery.GridSpec(bits=8), target="onnx")
    with surgery.quantize(model, spec, calibration=calibration) as handle:
        with mock.patch("onnxscript.optimizer.fold_constants"):  # the transposed weight left computed
            with pytest.raises(ConfigError, match=r"^export.handle='fc.weight': .* quantize.exclude=\[fc\] "):
                surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=calibration[:1])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("opset", ["x", 17, 26, True])
def test_onnx_refuses_an_opset_it_cannot_write(tmp_path, opset):
    model = mlp()  # the handle holds it weakly
    with surgery.quantize(model, activations=surgery.GridSpec(bits=8), calibration=[torch.randn(2, 64)]) as handle:
        with pytest.raises(ConfigError, match=r"^export.options.opset=.*: must be an integer from 18 to 25$"):
            surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=torch.randn(2, 64), opset=opset)


def tiny_falcon(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.FalconConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, vocab_size=64)
    return transformers.FalconForCausalLM(config).eval().to(dtype)


@pytest.mark.parametrize(
    ("fmt", "weights", "name"),
    [
        ("torchao", {"bits": 8, "per_channel": True}, "f.pt"),  # Int8Tensor has no `permute` (FalconLinear's .T)
        ("compressed-tensors", {"format": "mxfp4", "group_size": 32}, "f"),  # loading: FalconLinear has no `weight`
        ("compressed-tensors", {"format": "nvfp4", "group_size": 16}, "f"),
    ],
    ids=["torchao", "mxfp4", "nvfp4"],
)
def test_an_artifact_its_runtime_cannot_run_is_one_line_and_removed(tmp_path, fmt, weights, name):
    model = tiny_falcon(torch.bfloat16 if "format" in weights else torch.float32)
    ids = torch.randint(0, 64, (2, 8))
    spec = surgery.GridSpec(**weights)  # lm_head is tied to the embeddings: left out
    with surgery.quantize(model, weights=spec, activations=None, target=fmt, exclude=["lm_head"]) as handle:
        written = r"(the written FalconForCausalLM does not run|its runtime cannot load the written FalconForCausalLM)"
        with pytest.raises(ConfigError, match=rf"^export.format='{fmt}': {written}"):
            surgery.export(handle, tmp_path / name, format=fmt, inputs=[ids])
    assert list(tmp_path.iterdir()) == []


def test_compressed_tensors_options_are_checked_before_anything_is_written(tmp_path):
    model = tiny_llama(layers=1)
    (tmp_path / "a_file").write_text("not a tokenizer")
    (tmp_path / "empty").mkdir()
    bad = [
        ({"max_shard_size": "banana"}, r"^export.options.max_shard_size='banana': must be a size"),
        ({"max_shard_size": 0}, r"^export.options.max_shard_size=0: must be a size"),
        ({"tokenizer": str(tmp_path / "no_such")}, r"^export.options.tokenizer='.*no_such': must be a local tokenizer"),
        ({"tokenizer": str(tmp_path / "a_file")}, r"^export.options.tokenizer='.*a_file': must be a local tokenizer"),
        ({"tokenizer": str(tmp_path / "empty")}, r"^export.options.tokenizer='.*empty': cannot be loaded as a"),
    ]
    with surgery.quantize(model, weights=surgery.GridSpec(bits=8, per_channel=True), activations=None) as handle:
        for options, message in bad:
            with pytest.raises(ConfigError, match=message):
                surgery.export(handle, tmp_path / "out", format="compressed-tensors", **options)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "empty"]


def test_a_target_whose_layer_types_the_model_lacks_names_the_target_not_a_selection():
    model = gpt2()  # Conv1D layers; torchao quantizes nn.Linear, and lm_head is excluded
    spec = surgery.GridSpec(per_channel=True)
    with pytest.raises(ConfigError, match=r"^quantize.target='torchao': quantizes Linear layers and GPT2LMHeadModel"):
        surgery.quantize(model, weights=spec, activations=None, target="torchao", exclude=["lm_head"])


@pytest.mark.parametrize("per_channel", [False, True])
def test_gpt2_fp8_conv1d_weights_export_in_their_layout_with_equal_logits(tmp_path, per_channel):
    model = gpt2()  # FP8 has no zero point: "symmetric" was asked of it, and its Conv1D weights came out scrambled
    ids = torch.randint(0, 128, (2, 16))
    spec = surgery.GridSpec(format="fp8_e4m3", per_channel=per_channel)
    with surgery.quantize(model, weights=spec, activations=None, target="compressed-tensors") as handle:
        record = surgery.export(handle, tmp_path / "gpt2", format="compressed-tensors", inputs=[ids])
    assert record.parity.equal, record.parity


def test_a_quantized_head_tied_to_the_embeddings_is_refused_in_memory_and_streamed(tmp_path):
    model = tiny_llama(layers=1, vocab=64, hidden=32, heads=2, kv_heads=1, tied=True)
    model.save_pretrained(tmp_path / "tied")
    spec = surgery.GridSpec(bits=8, per_channel=True, symmetric=True)
    message = r"^quantize.select='lm_head': shares its weight with model.embed_tokens \(tied\)"
    with surgery.quantize(model, weights=spec, activations=None, select=["**.q_proj", "lm_head"]) as handle:
        with pytest.raises(ConfigError, match=message):
            surgery.export(handle, tmp_path / "ct", format="compressed-tensors")
    streamed = surgery.quantize(surgery.offloaded(tmp_path / "tied"), weights=spec, select=["**.q_proj", "lm_head"])
    with pytest.raises(ConfigError, match=message):
        surgery.export(streamed, tmp_path / "ct", format="compressed-tensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tied"]


def test_a_users_lambda_hook_at_torchao_export_is_named_and_nothing_is_written(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    model[1].register_forward_hook(lambda module, args, output: output * 2)
    spec = surgery.GridSpec(per_channel=True)
    with surgery.quantize(model, weights=spec, activations=None, target="torchao") as handle:
        with pytest.raises(ConfigError, match=r"^export.format='torchao': pickles .* layer '1' holds a forward hook"):
            surgery.export(handle, tmp_path / "m.pt", format="torchao")
    assert list(tmp_path.iterdir()) == []


def test_compressed_tensors_itself_refuses_actorder_group_so_no_folder_can_carry_a_g_idx():
    """Why format='compressed-tensors' refuses a weight with a g_idx: the library (0.19, 0.20)
    removed actorder='group' and its g_idx; if a release brings it back, this fails first."""
    quantization = pytest.importorskip("compressed_tensors.quantization")
    for value in ("group", "dynamic"):
        with pytest.raises(ValueError, match="has been removed"):
            quantization.QuantizationArgs(num_bits=4, strategy="group", group_size=16, actorder=value)


def test_a_hugging_face_decoder_traces_to_onnx_without_its_cache(tmp_path):
    # its cache object (DynamicCache) does not trace: the exported copy runs with use_cache off,
    # the graph gives the logits; before, every decoder failed in torch.export
    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    weights, activations = surgery.GridSpec(bits=8, per_channel=True, symmetric=True), surgery.GridSpec(bits=8)
    settings = dict(weights=weights, activations=activations, target="onnx", exclude="lm_head")
    with surgery.quantize(model, calibration=[ids], **settings) as handle:
        record = surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=[ids])
    assert record.parity.holds and record.int8_ops[0] >= 14, (record.parity, record.int8_ops)
    assert model.config.use_cache  # the model's own config untouched
