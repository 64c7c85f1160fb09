"""surgery.export: the file its own runtime loads computes what the model under surgery
computes, and what a format cannot hold is said, not dropped silently."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import surgery
from surgery.core.errors import ConfigError, OutputExistsError


def test_a_hugging_face_model_loads_the_export_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 12))
    spec = surgery.QuantizeSpec(weights=surgery.QuantSpec(bits=4, symmetric=True, per_channel=True))
    with surgery.quantize(model, spec) as handle:
        expected = model(ids).logits
        config.save_pretrained(tmp_path)
        record = surgery.export(handle, tmp_path / "model.safetensors")
    assert record.left_out == [] and record.bytes == (tmp_path / "model.safetensors").stat().st_size
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, local_files_only=True).eval()
    assert torch.equal(loaded(ids).logits, expected)


def test_a_timm_model_loads_the_export_strictly_and_gives_the_same_outputs(tmp_path):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    with surgery.prune(model, surgery.PruneSpec(0.5, method="ln_structured")) as handle:
        expected = model(x)
        record = surgery.export(handle, tmp_path / "pruned.safetensors")
    fresh = timm.create_model("resnet10t", pretrained=False, num_classes=10).eval()
    fresh.load_state_dict(record.load(), strict=True)
    assert torch.equal(fresh(x), expected)


def test_what_a_weights_file_cannot_hold_is_logged_and_listed(tmp_path, caplog):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    batches = [torch.randn(4, 8) for _ in range(2)]
    with surgery.quantize(model, activations=surgery.QuantSpec(bits=8), calibration=batches, progress=False) as h:
        with caplog.at_level(logging.WARNING, logger="surgery"):
            record = surgery.export(h, tmp_path / "w8a8.safetensors")
    assert record.left_out == ["activation quantization of 2 layer(s) (save_qparams keeps its parameters)"]
    assert record.as_dict()["left_out"] == record.left_out
    assert "holds the weights only; not in w8a8.safetensors: activation quantization" in caplog.text


def test_bad_export_arguments_are_one_line_and_write_nothing(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4))
    before = model[0].weight.detach().clone()
    with pytest.raises(ConfigError, match=r"^export.format='onnxx': must be one of safetensors"):
        surgery.export(model, tmp_path / "m.onnx", format="onnxx")
    with pytest.raises(ConfigError, match=r"^export.path='.*m.pt': must end in .safetensors"):
        surgery.export(model, tmp_path / "m.pt")
    with pytest.raises(ConfigError, match=r"^export.options=\['opset'\]: format='safetensors' takes no options"):
        surgery.export(model, tmp_path / "m.safetensors", opset=17)
    assert list(tmp_path.iterdir()) == [] and torch.equal(model[0].weight, before)
    surgery.export(model, tmp_path / "m.safetensors")
    with pytest.raises(OutputExistsError):
        surgery.export(model, tmp_path / "m.safetensors")


def test_a_weight_method_whose_answer_is_missing_or_broken_is_refused_and_the_model_kept():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    before = [p.detach().clone() for p in model.parameters()]
    answers = {
        "forgets": lambda problem: {},
        "zero_scale": lambda problem: {
            key: surgery.QuantizedWeight(torch.tensor(0.0), torch.tensor(0, dtype=torch.int32), None)
            for key in problem.targets.matched
        },
    }
    messages = {
        "forgets": r"^quantize.weights.method='forgets': returned no QuantizedWeight for 0.weight \(got NoneType\)$",
        "zero_scale": r"^quantize.weights.method='zero_scale': 0.weight.scale holds 0.0; every scale must be",
    }
    try:
        for name, solve in answers.items():
            surgery.register_weight_method(name, solve)
            with pytest.raises(ConfigError, match=messages[name]):
                surgery.quantize(model, weights=surgery.QuantSpec(method=name))
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    finally:
        from surgery.ops.weight_methods import WEIGHT_METHODS

        for name in answers:
            WEIGHT_METHODS.unregister(name)
