"""AWQ against a re-implementation of the reference code's ``run_awq`` (llm-awq: auto_scale_block
for Llama decoder layers, apply_scale, auto_clip_block) with the same weight quantizer, and as
a user runs it: it composes with RTN and GPTQ, restores bit for bit, refuses bad input."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from support import routed, tiny_llama, tiny_moe  # tests/support.py
from torch import nn

import surgery
from surgery import GridSpec
from surgery.core.errors import ConfigError
from surgery.ops.equivalence.awq import round_onto
from surgery.ops.numerics.fake_quant import fake_quantize
from surgery.ops.numerics.observers import Observer

SPEC = GridSpec(bits=3, group_size=32)


def calibration() -> list[torch.Tensor]:
    return [torch.randint(0, 128, (2, 256), generator=torch.Generator().manual_seed(1))]  # 512 tokens


def group_quantize(w: torch.Tensor) -> torch.Tensor:
    """llm-awq's pseudo_quantize_tensor over (..., group size): one scale per row of groups."""
    rows = w.reshape(-1, w.shape[-1])
    per_group = GridSpec(**{**SPEC.as_dict(), "group_size": None, "per_channel": True})
    observer = Observer(per_group, 0, "reference")
    observer.observe(rows)
    scale, zero_point = observer.qparams()
    return fake_quantize(rows, scale, zero_point, 0, per_group).reshape(w.shape)


def caught_layer_call(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The first decoder layer's hidden states and keyword arguments (llm-awq's Catcher)."""
    caught = {}

    def catch(module, args, kwargs):
        caught["inps"], caught["kwargs"] = args[0] if args else kwargs["hidden_states"], dict(kwargs)
        raise ValueError

    hook = model.model.layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    with contextlib.suppress(ValueError):
        model(ids)
    hook.remove()
    kwargs = {k: v for k, v in caught["kwargs"].items() if k != "hidden_states"}
    no_cache = {k: None for k, v in kwargs.items() if "past_key_value" in k or type(v).__name__.endswith("Cache")}
    return caught["inps"], {**kwargs, **no_cache, "use_cache": False}  # `cache=` since transformers 5.24


def search_module_scale(block, linears, x, kwargs, n_grid):
    """llm-awq's _search_module_scale."""
    org_out = block(x, **kwargs)
    org_out = org_out[0] if isinstance(org_out, tuple) else org_out
    x_max = x.abs().view(-1, x.shape[-1]).mean(0)
    best_error, best_scales = float("inf"), None
    org_sd = {k: v.clone() for k, v in block.state_dict().items()}
    for ratio in range(n_grid):
        ratio = ratio * 1 / n_grid
        scales = x_max.pow(ratio).clamp(min=1e-4).view(-1)
        scales = scales / (scales.max() * scales.min()).sqrt()
        for fc in linears:
            fc.weight.mul_(scales.view(1, -1))
            fc.weight.data = round_onto(fc.weight.data, SPEC) / (scales.view(1, -1))
        out = block(x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        loss = (org_out - out).float().pow(2).mean().item()
        if loss < best_error:
            best_error, best_scales = loss, scales
        block.load_state_dict(org_sd)
    return best_scales.view(-1).detach()


def auto_clip_layer(w, input_feat, n_grid, max_shrink=0.5, n_sample_token=512):
    """llm-awq's auto_clip_layer (its output-channel batching only saves memory: left out)."""
    feat = input_feat.view(-1, w.shape[1]).reshape(1, -1, w.shape[1] // 32, 32)
    feat = feat[:, 0 :: feat.shape[1] // n_sample_token]
    w4 = w.reshape(w.shape[0], 1, -1, 32)
    org_max = w4.abs().amax(dim=-1, keepdim=True)
    best_max, min_errs = org_max.clone(), torch.ones_like(org_max) * 1e9
    org_out = (feat * w4).sum(dim=-1)
    for i_s in range(int(max_shrink * n_grid)):
        max_val = org_max * (1 - i_s / n_grid)
        q_w = group_quantize(torch.clamp(w4, -max_val, max_val))
        err = ((feat * q_w).sum(dim=-1) - org_out).pow(2).mean(dim=1).view(min_errs.shape)
        better = err < min_errs
        min_errs[better], best_max[better] = err[better], max_val[better]
    return best_max.squeeze(1)


def reference_awq(model: nn.Module, ids: torch.Tensor, n_grid: int = 20) -> None:
    """llm-awq's run_awq (auto_scale + mse_range clipping) on a LlamaForCausalLM, in place."""
    inps, layer_kwargs = caught_layer_call(model, ids)
    for layer in model.model.layers:
        named_linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        input_feat: dict[str, torch.Tensor] = {}
        attn_kwargs: dict = {}
        hooks = [
            m.register_forward_pre_hook(lambda m, a, n=n, feat=input_feat: feat.__setitem__(n, a[0].detach()))
            for n, m in named_linears.items()
        ]
        hooks.append(
            layer.self_attn.register_forward_pre_hook(
                lambda m, a, k, store=attn_kwargs: store.update({x: v for x, v in k.items() if x != "hidden_states"}),
                with_kwargs=True,
            )
        )
        out = layer(inps, **layer_kwargs)
        for h in hooks:
            h.remove()
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.v_proj.weight.shape != attn.o_proj.weight.shape  # grouped key/value heads: v -> o is skipped
        scales_list = [
            (layer.input_layernorm, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], attn, attn_kwargs),
            (layer.post_attention_layernorm, ["mlp.gate_proj", "mlp.up_proj"], mlp, {}),
            (mlp.up_proj, ["mlp.down_proj"], mlp.down_proj, {}),
        ]
        found = [
            (
                prev,
                names,
                search_module_scale(block, [named_linears[n] for n in names], input_feat[names[0]], kw, n_grid),
            )
            for prev, names, block, kw in scales_list
        ]
        for prev, names, scales in found:  # apply_scale
            if isinstance(prev, nn.Linear):
                prev.weight[-scales.size(0) :].div_(scales.view(-1, 1))
            else:
                prev.weight.div_(scales)
            for name in names:
                named_linears[name].weight.mul_(scales.view(1, -1))
                input_feat[name] = input_feat[name].div(scales.view(1, -1))
        for name, fc in named_linears.items():  # auto_clip_block, apply_clip
            if not any(part in name for part in ["q_", "k_", "query", "key", "Wqkv"]):
                limit = auto_clip_layer(fc.weight, input_feat[name], n_grid)
                fc.weight.data = torch.clamp(fc.weight.reshape(*limit.shape[:2], -1), -limit, limit).reshape(
                    fc.weight.shape
                )
        inps = out[0] if isinstance(out, tuple) else out


def test_awq_equals_the_reference_run_awq_with_the_same_quantizer():
    ours, theirs = tiny_llama(layers=2), tiny_llama(layers=2)
    with torch.no_grad():
        handle = surgery.awq(ours, weights=SPEC, calibration=calibration(), progress=False)
        reference_awq(theirs, calibration()[0])
    assert [g.producer for g in handle.groups] == ["input_layernorm", "post_attention_layernorm", "mlp.up_proj"] * 2
    assert [g.layers[0].rsplit(".", 1)[1] for g in handle.skipped] == [
        "o_proj",
        "o_proj",
    ]  # as llm-awq: v and o differ in shape
    differ = {n: (p - dict(theirs.named_parameters())[n]).abs().max().item() for n, p in ours.named_parameters()}
    assert max(differ.values()) == 0.0, {n: d for n, d in differ.items() if d}
    handle.restore()
    fresh = tiny_llama(layers=2)
    assert all(torch.equal(p, dict(fresh.named_parameters())[n]) for n, p in ours.named_parameters())


def test_awq_on_a_model_whose_norm_is_not_foldable_skips_in_one_line(caplog):
    caplog.set_level(logging.INFO, "surgery")
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)]).eval()
    handle = surgery.awq(
        model, weights=GridSpec(bits=4, group_size=32), calibration=[torch.randn(8, 32)], progress=False
    )
    assert handle.groups == [] and len(handle.skipped) == 3  # nothing before each layer can absorb its scales
    assert "left out" in caplog.text
    handle.restore()


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda m: surgery.awq(m, weights=SPEC), "awq.calibration"),
        (lambda m: surgery.awq(m, weights=SPEC, calibration=calibration(), n_grid=0), "awq.n_grid"),
        (lambda m: surgery.awq(m, weights=SPEC, calibration=calibration(), n_grid=10**9), "awq.n_grid"),
        (lambda m: surgery.awq(m, weights=SPEC, calibration=calibration(), max_shrink=1.0), "awq.max_shrink"),
        (lambda m: surgery.awq(m, weights=SPEC, calibration=calibration(), blocks=False), "awq.blocks"),
    ],
)
def test_bad_awq_settings_are_one_line_and_change_nothing(call, field):
    model = tiny_llama(layers=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError) as caught:
        call(model)
    assert caught.value.field == field and "\n" not in str(caught.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_an_offloaded_model_gets_the_same_weights_block_by_block(tmp_path):
    model = tiny_llama(layers=2)
    small = [torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(2))]
    model.save_pretrained(tmp_path / "model")
    surgery.awq(model, weights=SPEC, calibration=small, progress=False).bake()
    source = surgery.offloaded(tmp_path / "model")
    done = surgery.awq(source, weights=SPEC, calibration=small, progress=False)
    assert done.blocks == 2
    tokens = small[0][:, :16]
    with torch.no_grad():
        assert torch.equal(source.model(tokens).logits, model(tokens).logits)
    done.restore()


def test_a_post_norm_bert_keeps_its_function_the_norms_feeding_the_residual_left_out(caplog):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=64
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with torch.no_grad():
        before = model(ids[0]).last_hidden_state
    handle = surgery.awq(model, weights=GridSpec(bits=4, group_size=32), calibration=ids, clip=False, progress=False)
    with torch.no_grad():
        after = model(ids[0]).last_hidden_state
    # scaling alone keeps the function: every group whose producer's output also feeds the
    # residual (BERT's post-attention LayerNorm feeds both the next block and its intermediate) is out
    assert torch.allclose(after, before, atol=1e-4), (after - before).abs().max()
    assert any("changes the block's output" in r.message for r in caplog.records)
    handle.restore()


def test_awq_after_quantize_is_refused_before_anything_changes():
    model = tiny_llama(layers=2)
    quantized = surgery.quantize(model, weights=GridSpec(bits=4, group_size=32), exclude="lm_head")
    with pytest.raises(ConfigError, match=r"awq=.*already has quantize attached; run awq first"):
        surgery.awq(model, weights=SPEC, calibration=calibration(), progress=False)
    quantized.restore()


def test_a_group_size_that_does_not_divide_a_layer_is_one_line():
    with pytest.raises(ConfigError, match=r"awq.weights.group_size=48: does not divide the 64 inputs of"):
        surgery.awq(tiny_llama(layers=2), weights=GridSpec(bits=4, group_size=48), calibration=calibration())


def test_awq_that_would_change_nothing_is_refused():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)]).eval()
    with pytest.raises(ConfigError, match=r"awq='Sequential': found no group .* it would change nothing"):
        surgery.awq(model, weights=GridSpec(bits=4, group_size=32), calibration=[torch.randn(8, 32)], clip=False)


MOE_BATCHES = [
    {"input_ids": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i))} for i in range(4)
]


@pytest.mark.parametrize(
    ("family", "router", "clip"),
    [("mixtral", "gate", False), ("deepseek_v3", "gate", False), ("phimoe", "router", True)],
)
def test_a_mixture_of_experts_norm_is_balanced_with_every_expert_and_its_float_router(family, router, clip):
    model = tiny_moe(family, layers=2)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    logits, chosen = routed(model, MOE_BATCHES[1])
    gate = model.model.layers[1].mlp.get_submodule(router)
    weight = gate.weight.detach().clone()
    spec = GridSpec(bits=4, group_size=16)
    handle = surgery.awq(model, weights=spec, calibration=MOE_BATCHES, n_grid=4, clip=clip, progress=False)
    group = next(g for g in handle.groups if g.producer == "post_attention_layernorm" and g.block == "model.layers.1")
    assert group.gates == [f"model.layers.1.mlp.{router}"] and group.inspected == "mlp"
    experts = {f"model.layers.1.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj")}
    assert experts <= set(group.layers)
    # the router takes the scales exactly, neither rounded nor clipped (PhiMoE's is a Linear): it stays float
    torch.testing.assert_close(gate.weight, weight * group.scales, rtol=1e-6, atol=0)
    if not clip:  # the scales alone leave the function as it was
        after, rerouted = routed(model, MOE_BATCHES[1])
        assert (after - logits).abs().max().item() <= 1e-5
        assert all(torch.equal(a, b) for a, b in zip(chosen, rerouted, strict=True))
    handle.restore()
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())


def test_the_awq_statistic_of_a_mixture_of_experts_group_is_over_every_token():
    model = tiny_moe("mixtral", layers=2)
    seen = []
    hook = model.model.layers[0].mlp.gate.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    with torch.no_grad():
        for batch in MOE_BATCHES:
            model(**batch)
    hook.remove()
    mean = torch.cat(seen).abs().mean(0)
    handle = surgery.awq(
        model, weights=GridSpec(bits=4, group_size=16), calibration=MOE_BATCHES, n_grid=4, progress=False
    )
    group = next(g for g in handle.groups if g.producer == "post_attention_layernorm")
    expected = mean.pow(group.ratio).clamp(min=1e-4)
    torch.testing.assert_close(group.scales, expected / (expected.max() * expected.min()).sqrt())
    handle.restore()
