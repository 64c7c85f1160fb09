"""Hadamard rotations fused into a Llama: the same function before quantization, restorable,
online rotations that refuse to bake, and models the rotation cannot cover refused by layer."""

from __future__ import annotations

import pytest
import torch
from support import routed, tiny_llama, tiny_moe  # tests/support.py

import surgery
from surgery.core.errors import ConfigError
from surgery.ops.equivalence.rotation import hadamard

transformers = pytest.importorskip("transformers")


def batches() -> list[torch.Tensor]:
    return [torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(2)]


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(batches()[1]).logits


@pytest.mark.parametrize("n", [64, 384, 5632])
def test_hadamard_matrices_are_orthogonal(n):
    q = hadamard(n, seed=3).double()
    assert torch.allclose(q @ q.t(), torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert q.abs().max() <= 1 / (n & -n) ** 0.5 + 1e-12  # every entry ±1/sqrt(block) or 0: outliers spread


@pytest.mark.parametrize("online", [True, False])
def test_the_rotated_model_computes_the_same_function_and_restores_bit_for_bit(online):
    model = tiny_llama(layers=2)
    before = logits(model)
    handle = surgery.rotate(model, calibration=batches(), online=online)
    assert handle.writers == [f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.o_proj", "mlp.down_proj")]
    assert "lm_head" in handle.readers and handle.embeddings == ["model.embed_tokens"]
    rotated = logits(model)
    assert not torch.equal(
        model.model.layers[0].self_attn.q_proj.weight, tiny_llama(layers=2).model.layers[0].self_attn.q_proj.weight
    )
    # float32 products of rotated weights: measured 4e-7 of the logits' range
    assert ((rotated - before).abs().max() / before.abs().max()) < 1e-5
    assert all(
        torch.equal(n.weight, torch.ones_like(n.weight)) for name, n in model.named_modules() if name.endswith("norm")
    )
    handle.restore()
    assert torch.equal(logits(model), before)


def test_a_one_layer_llama_rotates_its_writers_too():
    model = tiny_llama(layers=1)  # one decoder layer: its list is a run of one block
    before = logits(model)
    handle = surgery.rotate(model, calibration=batches())
    assert handle.writers == ["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"]
    assert ((logits(model) - before).abs().max() / before.abs().max()) < 1e-5  # as the two-layer test
    handle.restore()
    assert torch.equal(logits(model), before)


def test_online_rotations_refuse_to_bake_and_offline_ones_bake():
    model = tiny_llama(layers=2)
    before = logits(model)
    handle = surgery.rotate(model, calibration=batches())
    with pytest.raises(ConfigError, match="rotate.online='model.layers.0.mlp.down_proj'"):
        handle.bake()
    assert handle.state == "attached"
    handle.restore()
    baked = surgery.rotate(model, calibration=batches(), online=False).bake()
    assert ((logits(baked) - before).abs().max() / before.abs().max()) < 1e-5


def test_rotation_lets_int4_activations_lose_less():
    model = tiny_llama(layers=2)
    before = logits(model)
    spec = dict(weights=None, activations=surgery.GridSpec(bits=4, symmetric=True), where="input", exclude="lm_head")

    def error() -> float:
        handle = surgery.quantize(model, calibration=batches(), progress=False, **spec)
        found = (logits(model) - before).pow(2).mean().item()
        handle.restore()
        return found

    plain = error()
    rotated = surgery.rotate(model, calibration=batches())
    with_rotation = error()
    rotated.restore()
    assert with_rotation < plain  # on a random model the activations have few outliers: a modest gain


@pytest.mark.parametrize(
    ("build", "layer"),
    [
        (
            lambda: transformers.GPT2LMHeadModel(
                transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128)
            ),
            "transformer.h.0.ln_1",
        ),
        (lambda: tiny_llama_tied(), "lm_head"),
        (lambda: tiny_gemma(), "model.layers.0.input_layernorm"),  # scales by (1 + weight)
    ],
)
def test_models_the_rotation_cannot_cover_are_refused_naming_the_layer(build, layer):
    model = build().eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError) as caught:
        surgery.rotate(model, calibration=[torch.randint(0, 128, (1, 8))])
    assert f"'{layer}'" in str(caught.value) and "\n" not in str(caught.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def tiny_llama_tied():
    return tiny_llama(layers=1, tied=True).train()  # as built: the test sets its mode


def test_a_bfloat16_llama_rotates_within_its_own_rounding():
    model = tiny_llama(layers=2, dtype=torch.bfloat16)
    before = logits(model).float()
    handle = surgery.rotate(model, calibration=batches())
    # bfloat16 keeps 8 bits of mantissa: rotated weights round at ~4e-3; measured 6e-3 of the range
    assert ((logits(model).float() - before).abs().max() / before.abs().max()) < 0.03
    handle.restore()
    assert torch.equal(logits(model).float(), before)


def test_an_offloaded_llama_rotates_stage_by_stage_to_the_same_bits_as_in_memory(tmp_path):
    model = tiny_llama(layers=2)
    model.save_pretrained(tmp_path / "model")
    before = logits(model)
    surgery.rotate(model, calibration=batches()[:1], online=False)  # the head's norm gain crosses stages
    source = surgery.offloaded(tmp_path / "model")
    rotated = surgery.rotate(source, calibration=batches()[:1], online=False, progress=False)
    assert rotated.blocks == 2
    assert torch.equal(logits(source.model), logits(model))
    spec = surgery.GridSpec(bits=4, group_size=32, symmetric=True)
    quantized = surgery.quantize(source, weights=spec, exclude="lm_head", progress=False)
    surgery.export(quantized, tmp_path / "w4", format="compressed-tensors")
    in_memory = surgery.quantize(model, weights=spec, exclude="lm_head", progress=False)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "w4", local_files_only=True).eval()
    assert torch.equal(logits(loaded), logits(model))  # rotated, quantized, streamed, loaded: the same bits
    in_memory.restore()
    quantized.restore()
    rotated.restore()
    assert torch.equal(logits(source.model), before)  # the source files never changed
    with pytest.raises(ConfigError, match=r"^rotate.online=True: an offloaded model is rotated into its files"):
        surgery.rotate(source, calibration=batches()[:1])


def test_an_export_of_an_online_rotation_is_refused_naming_the_hook(tmp_path):
    model = tiny_llama(layers=2)
    rotated = surgery.rotate(model, calibration=batches()[:1])
    quantized = surgery.quantize(model, weights=surgery.GridSpec(bits=4, group_size=32, symmetric=True))
    both = surgery.compose(rotated, quantized)
    with pytest.raises(ConfigError, match=r"^export.handle='the online Hadamard before 2 layer\(s\) \(e.g. model"):
        surgery.export(both, tmp_path / "w4", format="compressed-tensors")
    assert not (tmp_path / "w4").exists()
    both.restore()


def tiny_gemma():
    config = transformers.GemmaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=128, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GemmaForCausalLM(config)


def test_a_gemma_norm_is_refused_saying_it_scales_by_one_plus_its_weight():
    with pytest.raises(
        ConfigError, match=r"^rotate='model.layers.0.input_layernorm': is a GemmaRMSNorm that scales by"
    ):
        surgery.rotate(tiny_gemma().eval(), calibration=[torch.randint(0, 128, (1, 8))])


def test_a_model_whose_outputs_are_nan_is_refused_before_rotating():
    model = tiny_llama(layers=1)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match=r"^rotate.calibration='batch 0': the model's outputs on it hold NaN"):
        surgery.rotate(model, calibration=[torch.randint(0, 128, (1, 8))], online=False)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, before[name], rtol=0, atol=0, equal_nan=True)


MOE_BATCHES = [
    {"input_ids": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i))} for i in range(2)
]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_a_mixture_of_experts_rotates_its_routers_and_experts_with_the_stream(family):
    model = tiny_moe(family, layers=2)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    logits, chosen = routed(model, MOE_BATCHES[1])
    handle = surgery.rotate(model, calibration=MOE_BATCHES[:1], progress=False)
    assert {"model.layers.1.mlp.gate", "model.layers.1.mlp.router"} & set(handle.readers)  # the router
    assert {f"model.layers.1.mlp.experts.{e}.up_proj" for e in range(4)} <= set(handle.readers)
    assert {f"model.layers.1.mlp.experts.{e}.down_proj" for e in range(4)} <= set(handle.writers)
    rotated, rerouted = routed(model, MOE_BATCHES[1])
    assert ((rotated - logits).abs().max() / logits.abs().max()).item() <= 1e-4
    assert all(torch.equal(a, b) for a, b in zip(chosen, rerouted, strict=True))
    handle.restore()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], v) for n, v in before.items())


def test_a_rotated_mixture_of_experts_bakes_into_its_own_fused_classes():
    model = tiny_moe("qwen3_moe", layers=2)
    fused = type(model.model.layers[0].mlp.experts)
    logits, _ = routed(model, MOE_BATCHES[1])
    surgery.rotate(model, calibration=MOE_BATCHES[:1], online=False, progress=False).bake()
    assert type(model.model.layers[0].mlp.experts) is fused
    baked, _ = routed(model, MOE_BATCHES[1])
    assert ((baked - logits).abs().max() / logits.abs().max()).item() <= 1e-4


def test_a_mixture_of_experts_with_layer_norms_is_refused_for_its_norms():
    with pytest.raises(ConfigError, match=r"^rotate='model.layers.0.input_layernorm': is a LayerNorm, which subtracts"):
        surgery.rotate(tiny_moe("phimoe", layers=1), calibration=MOE_BATCHES[:1], progress=False)
