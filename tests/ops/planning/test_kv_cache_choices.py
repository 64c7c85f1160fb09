"""KV-cache dtypes as plan choices: the cache counted at ``kv_tokens`` in the same bytes budget
as the weights, scored like the weights (gradient or drift), applied as
``surgery.quantize_kv_cache`` applies it, restored bit for bit, and the misuses refused."""

from __future__ import annotations

import pytest
import torch
from support import tiny_gpt2, tiny_llama  # tests/support.py

import surgery
from surgery.core.errors import ConfigError
from surgery.ops.planning.choices import CHOICES
from surgery.ops.planning.plans import Plan, PlanRow
from surgery.ops.quantization.kv_cache import DEFAULT_KV, quantize_kv_cache
from surgery.testing import snapshot, snapshot_differences

WEIGHTS = ["dense", "int8", "w4g128"]
CACHES = ["kv16", "kv_int8", "kv_int4", "kv_fp8"]
ATTENTION = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
TOKENS = 512


def ids(seed: int = 0, batches: int = 2) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=generator) for _ in range(batches)]


def logits(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(batch).logits


def test_each_cache_choice_counts_every_cached_value_and_its_scales():
    values = 64  # tiny_llama: k_proj and v_proj each write 2 heads of 16
    bits = {name: CHOICES[name].bits((values, TOKENS)) for name in CACHES}
    assert bits == {
        "kv16": values * TOKENS * 16,
        "kv_int8": values * TOKENS * 8 + values * 16,  # a static 16-bit scale per channel
        "kv_int4": values * TOKENS * 4 + values * 16,
        "kv_fp8": values * TOKENS * 8 + 2 * 16,  # one scale per projection
    }


def test_the_budget_trades_cache_bits_against_weight_bits_and_the_model_is_kept():
    model = tiny_llama(layers=2)
    before = snapshot(model)
    roomy = surgery.plan(model, 10**7, WEIGHTS + CACHES, calibration=ids(), kv_tokens=TOKENS)
    assert roomy.counts() == {"dense": 14, "kv16": 2}  # nothing is lost where everything fits
    assert [r.layer for r in roomy.rows if r.target == "kv_cache"] == ATTENTION
    assert roomy.kv_cache_bytes == 2 * 64 * TOKENS * 2 and roomy.kv_tokens == TOKENS
    tight = surgery.plan(model, roomy.total_bytes // 3, WEIGHTS + CACHES, calibration=ids(), kv_tokens=TOKENS)
    assert tight.total_bytes <= tight.budget == roomy.total_bytes // 3
    assert tight.kv_cache_bytes < roomy.kv_cache_bytes and tight.bits_per_weight < 16
    assert tight.weights == roomy.weights == sum(r.shape[0] * r.shape[1] for r in tight.rows if r.target == "weight")
    assert snapshot_differences(before, snapshot(model)) == []


def test_a_cache_choice_s_gradient_score_is_half_the_squared_gradient_times_its_squared_rounding():
    model = tiny_llama(layers=2)
    batches = ids()
    labelled = [{"input_ids": x, "labels": x} for x in batches]
    plan = surgery.plan(model, 10**7, ["dense", "kv_int8"], calibration=labelled, kv_tokens=TOKENS)
    score = next(r.score for r in plan.rows if r.layer == ATTENTION[0])
    # by hand, on the first attention (whose projections' inputs no other cache choice changes)
    layers = [f"{ATTENTION[0]}.{p}" for p in ("k_proj", "v_proj")]
    squared: dict[str, list] = {layer: [] for layer in layers}
    for batch in labelled:
        found = {}
        hooks = [
            model.get_submodule(layer).register_forward_hook(
                lambda m, a, out, layer=layer, found=found: found.update({layer: out})
            )
            for layer in layers
        ]
        loss = model(**batch).loss
        for hook in hooks:
            hook.remove()
        grads = torch.autograd.grad(loss, [found[layer] for layer in layers])
        for layer, grad in zip(layers, grads):
            squared[layer].append((found[layer].detach(), grad.square()))
    with quantize_kv_cache(model, DEFAULT_KV, calibration=batches, attention=[ATTENTION[0]], progress=False):
        expected = 0.0
        for layer in layers:
            module = model.get_submodule(layer)
            for unrounded, g2 in squared[layer]:
                quantizer = next(iter(module._forward_hooks.values()))
                rounded = quantizer(module, (), unrounded)
                expected += float(0.5 * (g2 * (rounded - unrounded).square()).sum())
    assert expected > 0 and score == pytest.approx(expected, rel=1e-5)


def test_a_cache_choice_applies_as_quantize_kv_cache_does_and_restores_bit_for_bit():
    model = tiny_llama(layers=2)
    batches, probe = ids(), ids(seed=1, batches=1)[0]
    reference, before = logits(model, probe), snapshot(model)
    plan = surgery.plan(model, 10**7, ["dense", "kv_int8"], calibration=batches, kv_tokens=TOKENS)
    with quantize_kv_cache(model, DEFAULT_KV, calibration=batches, progress=False):
        direct = logits(model, probe)
    handle = plan.apply(model, calibration=batches)
    planned = logits(model, probe)
    handle.restore()
    assert not torch.equal(direct, reference) and torch.equal(planned, direct)
    assert torch.equal(logits(model, probe), reference) and snapshot_differences(before, snapshot(model)) == []


def test_a_saved_plan_with_caches_loads_back_equal(tmp_path):
    model = tiny_llama(layers=2)
    plan = surgery.plan(model, 100_000, WEIGHTS + CACHES, calibration=ids(), kv_tokens=TOKENS)
    for suffix in (".json", ".yaml"):
        loaded = Plan.load(plan.save(tmp_path / f"plan{suffix}"))
        assert loaded == plan and loaded.kv_cache_bytes == plan.kv_cache_bytes > 0
    assert f"KV cache {plan.kv_cache_bytes:,} bytes at {TOKENS:,} tokens" in str(plan)


@pytest.mark.parametrize(
    ("budget", "choices", "tokens", "message"),
    [
        (10**7, WEIGHTS + CACHES, None, r"^plan\.kv_tokens=None: must be the tokens the cache holds"),
        (10**7, WEIGHTS + CACHES, 0, r"^plan\.kv_tokens=0: must be the tokens the cache holds"),
        (10**7, WEIGHTS, TOKENS, r"^plan\.kv_tokens=512: counts a KV cache; add KV-cache choices"),
        ("4.5bpw", WEIGHTS + CACHES, TOKENS, r"^plan\.budget='4\.5bpw': must be bytes .* KV cache"),
        (10_000, WEIGHTS + CACHES, TOKENS, r"smallest reachable: [\d,]+ bytes with every layer at w4g128, every cache"),
    ],
)
def test_misused_cache_choices_are_refused_in_one_line(budget, choices, tokens, message):
    with pytest.raises(ConfigError, match=message):
        surgery.plan(tiny_llama(layers=1), budget, choices, calibration=ids(), kv_tokens=tokens)


def test_a_model_without_key_and_value_projections_is_refused_for_cache_choices():
    model = tiny_gpt2()  # c_attn writes queries, keys and values in one output
    with pytest.raises(ConfigError, match=r"^plan\.choices=\['kv_int8'\]: GPT2LMHeadModel has no attention module"):
        surgery.plan(model, 10**7, ["dense", "kv_int8"], calibration=ids(), kv_tokens=TOKENS)


def test_a_cache_choice_on_a_weight_row_is_refused_before_anything_changes():
    model = tiny_llama(layers=1)
    before = snapshot(model)
    rows = [PlanRow("model.layers.0.mlp.up_proj", "kv_int8", (128, 64), 1, 0.0)]
    with pytest.raises(ConfigError, match=r"^plan\.layers\.choice='kv_int8': is no choice for a weight"):
        Plan(rows, 10, "drift", "exact").apply(model, calibration=ids())
    assert snapshot_differences(before, snapshot(model)) == []


def test_a_mixture_of_experts_model_plans_its_caches_beside_its_linears(caplog):
    from support import tiny_moe

    model = tiny_moe("qwen3_moe", layers=2)
    before = snapshot(model)
    batches = [torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    plan = surgery.plan(model, 60_000, WEIGHTS + CACHES, calibration=batches, kv_tokens=TOKENS)
    caches = [row for row in plan.rows if row.target == "kv_cache"]
    assert [row.layer for row in caches] == ATTENTION and plan.total_bytes <= plan.budget
    # its fused experts are not planned: said, with their share, not left to look covered
    assert "plan: 4 fused expert weight(s)" in caplog.text and "are not planned" in caplog.text
    with plan.apply(model, calibration=batches):
        pass
    assert snapshot_differences(before, snapshot(model)) == []
