"""A tiny Hugging Face GPT-2 built from a config (never downloaded), fed dict batches."""

from __future__ import annotations

import pytest
import torch

import surgery

transformers = pytest.importorskip("transformers")

from support import tiny_gpt2  # tests/support.py  # noqa: E402


def token_batches(n: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [
        {"input_ids": torch.randint(0, 64, (2, 8), generator=g), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
        for _ in range(n)
    ]


def test_calibrated_criterion_compare_and_capture_on_gpt2_with_dict_batches():
    model, reference, batches = tiny_gpt2(), tiny_gpt2(), token_batches()
    seen: dict[str, tuple] = {}

    def recording(weight, stats):  # what a Wanda-style criterion receives for each layer
        seen[stats.name] = (tuple(weight.shape), stats.input_sq_norms.numel(), stats.rows)
        return weight.abs()

    with surgery.prune(
        model, 0.5, method=recording, calibration=batches, select="transformer.h.*.mlp.*", progress=False
    ) as handle:
        assert handle.sparsity() == pytest.approx(0.5)
        # Hugging Face Conv1D keeps (in_features, out_features): the statistics are per input feature
        assert seen == {
            "transformer.h.0.mlp.c_fc": ((32, 128), 32, 32),
            "transformer.h.0.mlp.c_proj": ((128, 32), 128, 32),
            "transformer.h.1.mlp.c_fc": ((32, 128), 32, 32),
            "transformer.h.1.mlp.c_proj": ((128, 32), 128, 32),
        }
        drift = surgery.compare(reference, model, batches)  # ModelOutput: the logits are compared
        assert drift.finite and not drift.identical and drift.top1_agreement is not None
        with surgery.capture(model, select="transformer.h.*.attn", what="outputs") as captured:
            model(**batches[0])
        assert [t.shape for t in captured.outputs["transformer.h.0.attn"]] == [(2, 8, 32)]
    assert surgery.compare(reference, model, batches).identical


def test_capture_and_calibrated_prune_on_a_timm_vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2).eval()
    images = [torch.randn(2, 3, 32, 32) for _ in range(2)]
    with surgery.capture(model, select="blocks.*.mlp.fc1", what="inputs", reduce="sq_norms") as seen:
        for x in images:
            model(x)
    assert {name: (s["sq_norms"].shape, s["rows"]) for name, s in seen.inputs.items()} == {
        "blocks.0.mlp.fc1": ((192,), 2 * 2 * 17),
        "blocks.1.mlp.fc1": ((192,), 2 * 2 * 17),
    }  # 16 patches + cls
    with surgery.prune(
        model,
        0.5,
        select="blocks.*.mlp.*",
        calibration=images,
        progress=False,
        method=lambda w, stats: w.abs() * stats.norms_like(w),
    ) as handle:
        assert handle.sparsity() == pytest.approx(0.5)
