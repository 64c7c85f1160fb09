"""Bits per weight and bytes against fp32 of a quantized model (the quantize step's report)."""

from __future__ import annotations

import pytest
from support import tiny_llama  # tests/support.py

import surgery
from surgery import GridSpec
from surgery.ops.quantization.storage import weight_storage


@pytest.mark.parametrize(
    ("spec", "bits"),
    [
        (GridSpec(bits=4, symmetric=True, group_size=32), 4 + 16 / 32),  # a half-precision scale per 32 weights
        (GridSpec(bits=4, symmetric=False, group_size=64), 4 + (16 + 8) / 64),  # and an 8-bit zero point
        (GridSpec(format="mxfp4"), 4 + 8 / 32),  # E8M0 block scales
    ],
)
def test_bits_per_weight_count_the_values_and_their_scales(spec, bits):
    model = tiny_llama(layers=1)
    with surgery.quantize(model, weights=spec, exclude="lm_head") as handle:
        stored = weight_storage(handle)
    linear = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    total = sum(p.numel() for p in model.parameters())
    assert stored["weights"] == 7 and stored["bits_per_weight"] == pytest.approx(bits)
    assert stored["share_of_parameters"] == pytest.approx(linear / total)
    expected = linear * bits / 8 + (total - linear) * 4
    assert stored["bytes"] == int(expected) and stored["bytes_vs_fp32"] == pytest.approx(expected / (4 * total))


def test_a_quantization_run_says_bits_and_bytes_and_no_sparsity_it_did_not_make():
    from surgery.cli.reporting import summary_table

    report = {
        "recipe": "quantize_gptq_llama",
        "model": "llama",
        "steps": ["quantize"],
        "sparsity": 0.0,
        "sparsity_over": {"parameters": 0, "entries": 0},
        "params": {"total": 361088, "nonzero": 361088},
        "quantize": {"weights": 14, "share_of_parameters": 0.82, "bits_per_weight": 4.125, "bytes": 108288}
        | {"bytes_fp32": 361728, "bytes_vs_fp32": 0.299},
        "checks": [],
        "drift": {"cosine": 0.99, "sqnr_db": 20.0, "max_abs": 0.1, "top1_agreement": None},
        "perplexity": {"reference": 3.24, "candidate": 3.31},
        "ok": True,
    }
    lines = summary_table(report).splitlines()
    assert "sparsity" not in lines[0] and "non-zero" not in lines[0]
    assert lines[1] == (
        "  quantize: 4.12 bits per weight on 82% of the parameters; the model 0.108 MB, 0.299x its fp32 bytes"
    )
    assert lines[2] == "  perplexity (held out): reference 3.240  candidate 3.310"  # the headline: what it cost
