"""``format="int4"``: a bfloat16 model's 4-bit Linear weights in torch's own CPU int4 layout and
kernel (``_weight_int4pack_mm_for_cpu``), from surgery's integers, scales and zero points."""

from __future__ import annotations

import pytest
import torch
import transformers
from support import tiny_llama  # tests/support.py

import surgery
from surgery import GridSpec
from surgery.core.errors import ConfigError
from surgery.ops.export.formats.int4_linear import Int4Linear


def bfloat16_llama(tmp_path) -> torch.nn.Module:
    tiny_llama(layers=2).save_pretrained(tmp_path / "float")
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64])
def test_int4_linears_compute_the_simulation_s_weights(tmp_path, symmetric, group):
    model = bfloat16_llama(tmp_path)
    spec = GridSpec(bits=4, group_size=group, symmetric=symmetric)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with surgery.quantize(model, weights=spec, exclude="lm_head") as handle:
        record = surgery.export(handle, tmp_path / "m.pt", format="int4", inputs=[ids])
    # the kernel multiplies in bfloat16 with the zero folded to bfloat16: measured cosine 0.99998
    assert record.parity.holds and record.parity.cosine > 0.9999
    loaded = record.load()
    assert sum(isinstance(m, Int4Linear) for m in loaded.modules()) == 14  # every Linear but the head


def test_the_packed_weights_decode_to_the_simulation_s_weights(tmp_path):
    # one-hot inputs read the weight back column by column: equal to the simulated weight
    # within the bfloat16 rounding of the folded zero (one bfloat16 step of its magnitude)
    model = bfloat16_llama(tmp_path)
    with surgery.quantize(model, weights=GridSpec(bits=4, group_size=32), select="**.up_proj") as handle:
        record = surgery.export(handle, tmp_path / "m.pt", format="int4")
        weight = model.model.layers[0].mlp.up_proj.weight.detach().float()
    layer = record.load().model.layers[0].mlp.up_proj
    read = layer(torch.eye(layer.in_features, dtype=torch.bfloat16)).float().t()
    assert torch.allclose(read, weight, rtol=2**-7, atol=2**-7 * weight.abs().max().item())


@pytest.mark.parametrize(
    ("dtype", "weights", "message"),
    [
        (torch.float32, GridSpec(bits=4, group_size=32), r"^export\.format='int4': .* is torch\.float32"),
        (torch.bfloat16, GridSpec(bits=8, group_size=32), r"^quantize\.weights='.*: 8-bit group 32': format='int4'"),
        (torch.bfloat16, GridSpec(bits=4, group_size=16), r"group 16'"),
    ],
)
def test_what_the_int4_kernel_cannot_run_is_refused_in_one_line(tmp_path, dtype, weights, message):
    model = bfloat16_llama(tmp_path).to(dtype) if dtype != torch.bfloat16 else bfloat16_llama(tmp_path)
    with surgery.quantize(model, weights=weights, exclude="lm_head") as handle:
        with pytest.raises(ConfigError, match=message):
            surgery.export(handle, tmp_path / "m.pt", format="int4")
    assert not (tmp_path / "m.pt").exists()


def test_outputs_the_int4_layout_cannot_tile_are_refused_naming_the_layer(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).to(torch.bfloat16)
    with surgery.quantize(model, weights=GridSpec(bits=4, group_size=32)) as handle:
        with pytest.raises(
            ConfigError, match=r"^export\.handle='2 \(32 -> 10\)': torch's CPU int4 layout takes outputs"
        ):
            surgery.export(handle, tmp_path / "m.pt", format="int4")
