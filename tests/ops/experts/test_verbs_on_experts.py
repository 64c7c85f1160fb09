"""Every verb reaches each expert of a fused experts module as a layer of its own, restores bit for
bit, bakes into the model's own classes, and says in one line when an expert got no tokens."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import surgery
from surgery import GridSpec
from surgery.core.errors import ConfigError
from surgery.ops.experts.linear_experts import LinearExperts
from tests.support import tiny_moe

BATCHES = [{"input_ids": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i))} for i in range(4)]

VERBS = {
    "rtn": lambda model: surgery.quantize(model, weights=GridSpec(bits=4, group_size=16)),
    "gptq": lambda model: surgery.quantize(model, weights=GridSpec(bits=4), method="gptq", calibration=BATCHES),
    "magnitude": lambda model: surgery.prune(model, 0.5),
    "wanda": lambda model: surgery.prune(model, 0.5, method="wanda", calibration=BATCHES),
    "sparsegpt": lambda model: surgery.prune(model, 0.5, method="sparsegpt", calibration=BATCHES),
    "gptaq": lambda model: surgery.quantize(model, weights=GridSpec(bits=4), method="gptaq", calibration=BATCHES),
    "autoround": lambda model: surgery.quantize(
        model,
        weights=GridSpec(bits=4, group_size=16),
        method={"name": "autoround", "iterations": 5},
        calibration=BATCHES,
    ),
}


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_each_expert_is_a_layer_and_restore_is_exact(family, verb):
    model = tiny_moe(family, layers=2)
    before = _state(model)
    with surgery.every_expert_calibrated():  # GPT-OSS routes no token of these batches to some experts
        handle = VERBS[verb](model)
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, LinearExperts)
    matched = handle.selection.matched
    assert {
        f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")
    } <= set(matched)
    assert handle.selection.coverage.left_share < 0.2  # the embedding and routers only
    changed = experts[2].down_proj.weight
    assert not torch.equal(
        changed,
        before["model.layers.1.mlp.experts.down_proj"][2].T
        if family == "gpt_oss"
        else before["model.layers.1.mlp.experts.down_proj"][2],
    )
    handle.restore()
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], value) for name, value in before.items())


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bake_leaves_the_model_s_own_classes_holding_the_change(family):
    model = tiny_moe(family, layers=2)
    fused_class = type(model.model.layers[0].mlp.experts)
    handle = surgery.prune(model, 0.5)
    handle.bake()
    experts = model.model.layers[0].mlp.experts
    assert type(experts) is fused_class
    share = float((experts.down_proj == 0).float().mean())
    assert share == 0.5


def test_an_expert_its_router_never_chose_is_named_with_the_way_out():
    model = tiny_moe("gpt_oss", layers=2)
    before = _state(model)
    with pytest.raises(
        ConfigError,
        match=r"expert \d+ of model.layers.\d.mlp.experts was sent no calibration token.*every_expert_calibrated",
    ):
        VERBS["gptq"](model)
    assert not isinstance(model.model.layers[0].mlp.experts, LinearExperts)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())


def test_tokens_per_expert_are_on_the_handle():
    model = tiny_moe("qwen3_moe", layers=2)
    with VERBS["wanda"](model) as handle:
        counts = handle.tokens_per_expert
    assert set(counts) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    routed_per_pass = (
        4 * 2 * 16 * 2
    )  # batches x rows x tokens x top-2; a block-by-block walk runs a block more than once
    assert all(sum(per) % routed_per_pass == 0 and min(per) > 0 for per in counts.values())


def test_awq_scales_each_expert_s_down_proj_through_its_up_proj():
    model = tiny_moe("qwen3_moe", layers=2)
    before = _state(model)
    handle = surgery.awq(model, calibration=BATCHES, weights=GridSpec(bits=4, group_size=16), progress=False)
    scaled = {(group.producer, tuple(group.layers)) for group in handle.groups}
    for e in range(4):
        assert (f"mlp.experts.{e}.up_proj", (f"model.layers.1.mlp.experts.{e}.down_proj",)) in scaled
    handle.restore()
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())


def test_every_weight_handle_states_its_coverage():
    model = tiny_moe("olmoe", layers=2)
    with surgery.prune(model, 0.5) as pruned, surgery.quantize(model) as quantized:
        for handle in (pruned, quantized):
            assert handle.coverage.share > 0.8  # the experts are reached
            assert handle.coverage.largest_left[0].name == "model.embed_tokens.weight"


def test_handles_without_a_selection_state_the_coverage_of_what_they_changed():
    model = tiny_moe("qwen3_moe", layers=2)
    with surgery.smooth(model, calibration=BATCHES) as handle:
        coverage = handle.coverage
    assert 0.5 < coverage.share < 0.7  # norms, attention projections, routers and experts' gate and up projections
    assert coverage.largest_left[0].reason == "not changed by smooth"


def test_onnx_cannot_hold_experts_yet_and_refuses_in_one_line_before_writing(tmp_path):
    model = tiny_moe("mixtral", layers=2)
    with surgery.quantize(model, weights=GridSpec(bits=8, symmetric=True)) as handle:
        with pytest.raises(ConfigError, match="writes no mixture-of-experts layer yet .*format='torchao' holds them"):
            surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=BATCHES[0])
    assert list(tmp_path.iterdir()) == []


def test_compressed_tensors_holds_the_experts_of_a_default_selection(tmp_path):
    pytest.importorskip("compressed_tensors")
    model = tiny_moe("mixtral", layers=2)
    with surgery.quantize(model, weights=GridSpec(bits=8, symmetric=True)) as handle:
        record = surgery.export(handle, tmp_path / "folder", format="compressed-tensors", inputs=BATCHES[0])
    assert record.parity.equal and record.parity.holds


def test_a_composed_prune_and_quantize_bake_together_into_the_model_s_own_classes():
    model = tiny_moe("gpt_oss", layers=2)
    fused_class = type(model.model.layers[0].mlp.experts)
    group = surgery.compose(surgery.prune(model, 0.5), surgery.quantize(model, weights=GridSpec(bits=4, group_size=16)))
    with torch.no_grad():
        hooked = model(**BATCHES[0]).logits
    group.bake()
    assert type(model.model.layers[0].mlp.experts) is fused_class
    with torch.no_grad():
        assert torch.equal(model(**BATCHES[0]).logits, hooked)


def test_a_fused_bias_selects_the_biases_and_excluding_a_block_excludes_its_layers():
    model = tiny_moe("gpt_oss", layers=2)
    before = _state(model)
    surgery.quantize(model, weights=GridSpec(bits=4), select=r"re:.*down_proj_bias").bake()
    changed = {name for name, value in model.state_dict().items() if not torch.equal(value, before[name])}
    assert changed == {f"model.layers.{i}.mlp.experts.down_proj_bias" for i in range(2)}
    with surgery.prune(model, 0.5, exclude="**.experts") as handle:
        assert not any(".experts." in name for name in handle.selection.matched)
        assert handle.coverage.left_share < 0.2  # excluded by the user: not counted as left untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_biased_experts_add_their_bias_after_the_product_as_the_fused_module_does(dtype):
    model = tiny_moe("gpt_oss", layers=2).to(dtype)
    with torch.no_grad():
        plain = model(**BATCHES[0]).logits
        with surgery.prune(model, 0.0):
            assert torch.equal(model(**BATCHES[0]).logits, plain)


def test_state_dict_and_save_pretrained_while_attached_give_the_model_s_own_keys(tmp_path):
    import transformers

    model = tiny_moe("qwen3_moe", layers=2)
    keys = list(model.state_dict())
    with surgery.prune(model, 0.5):
        state = model.state_dict()
        assert list(state) == keys
        with torch.no_grad():
            pruned = model(**BATCHES[0]).logits
        model.save_pretrained(tmp_path)
        model.load_state_dict(state)  # the fused entries split back into the per-expert layers
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(**BATCHES[0]).logits, pruned)


def test_sensitivity_ranks_each_expert_s_layers():
    model = tiny_moe("mixtral", layers=1)
    before = _state(model)
    table = surgery.sensitivity(model, (0.5,), calibration=BATCHES[:1], progress=False)
    layers = {row.layer for row in table.rows}
    assert {f"model.layers.0.mlp.experts.{e}.down_proj" for e in range(4)} <= layers
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())


def test_the_kv_cache_needs_no_tokens_in_every_expert():
    model = tiny_moe("gpt_oss", layers=2)  # these batches reach only some experts
    with surgery.quantize_kv_cache(model, calibration=BATCHES) as handle:
        assert handle is not None


def test_finetune_and_distill_train_each_expert_while_its_mask_holds():
    model = tiny_moe("mixtral", layers=2)
    teacher = tiny_moe("mixtral", layers=2)
    before = _state(model)
    pruned = surgery.prune(model, 0.5)
    experts = model.model.layers[0].mlp.experts
    masks = [(expert.down_proj.weight == 0).clone() for expert in experts]
    pruned_weights = [expert.down_proj.weight.detach().clone() for expert in experts]
    batches = [(batch["input_ids"], batch["input_ids"]) for batch in BATCHES]
    tuned = surgery.finetune(model, calibration=batches, lr=1e-2, teacher=teacher, progress=False)
    for expert, mask, old in zip(experts, masks, pruned_weights, strict=True):
        assert torch.equal(expert.down_proj.weight[mask], torch.zeros(int(mask.sum())))
        assert not torch.equal(expert.down_proj.weight, old)  # every expert trained: each was routed tokens
    tuned.restore()
    pruned.restore()
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_gptaq_pairs_each_expert_s_inputs_when_every_expert_is_calibrated_and_says_why_not_otherwise():
    model = tiny_moe("qwen3_moe", layers=2)
    before = _state(model)
    batches = [
        {"input_ids": torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(i))} for i in range(8)
    ]
    spec = GridSpec(bits=3, group_size=16)
    with pytest.raises(ConfigError, match=r"experts.*GPTAQ cannot pair them row for row.*every_expert_calibrated"):
        surgery.quantize(
            model, weights=spec, method="gptaq", calibration=batches
        )  # the quantized layer 0 routes layer 1 otherwise
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    with surgery.every_expert_calibrated():  # every token through every expert, in both streams
        handle = surgery.quantize(model, weights=spec, method="gptaq", calibration=batches)
    assert handle.coverage.share > 0.9
    handle.restore()
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


@pytest.mark.parametrize("method", ["gptq", "autoround"])
def test_unrouted_rtn_rounds_an_expert_its_router_never_chose_to_nearest_and_says_which(method, caplog):
    """The default refuses (above); unrouted='rtn' gives such an expert round to nearest, never
    its float weights (a vLLM or llama.cpp checkpoint would hold them by accident), and lists it."""
    model = tiny_moe("gpt_oss", layers=2)
    chosen = {"name": "autoround", "iterations": 2} if method == "autoround" else method
    with pytest.raises(ConfigError, match=r"was sent no calibration token by its router"):
        surgery.quantize(model, weights=GridSpec(bits=4, group_size=16), method=chosen, calibration=BATCHES)
    reference = copy.deepcopy(model)
    rtn = surgery.quantize(reference, weights=GridSpec(bits=4, group_size=16), exclude="lm_head")
    with caplog.at_level(logging.WARNING, logger="surgery"):
        handle = surgery.quantize(
            model,
            weights=GridSpec(bits=4, group_size=16),
            method=chosen,
            calibration=BATCHES,
            exclude="lm_head",
            unrouted="rtn",
        )
    try:
        unrouted = handle.sequential.unrouted
        assert unrouted and all(".mlp.experts." in layer for layer in unrouted), unrouted
        said = [r.getMessage() for r in caplog.records if "no calibration input reached it" in r.getMessage()]
        assert len(said) == len(unrouted) and all("unrouted='rtn'" in line for line in said)
        for layer in unrouted:  # that expert's own layer: round to nearest, exactly (both attached: per expert)
            assert torch.equal(model.get_submodule(layer).weight, reference.get_submodule(layer).weight), layer
        routed = next(
            n for n, m in model.named_modules() if ".experts." in n and hasattr(m, "weight") and n not in unrouted
        )
        if method == "gptq":  # a routed expert was solved (AutoRound's two steps may keep their start, RTN)
            assert not torch.equal(model.get_submodule(routed).weight, reference.get_submodule(routed).weight)
        from surgery.cli.steps import STEPS
        from surgery.ops.quantization.storage import weight_storage

        handle.storage, report = weight_storage(handle), {}
        STEPS.get("quantize").reporting.report(handle, None, None, report)  # the command line's report.json
        assert report["quantize"]["unrouted"] == dict.fromkeys(unrouted, "rtn")
        summary = STEPS.get("quantize").reporting.summary(report)
        assert f" {len(unrouted)} layer(s) no calibration token reached, rounded to nearest" in summary[1]
    finally:
        rtn.restore()
        handle.restore()


def test_unrouted_takes_refuse_or_rtn_in_one_line():
    with pytest.raises(ConfigError, match=r"^quantize.unrouted='drop': must be one of refuse, rtn \(what a layer"):
        surgery.QuantizeSpec(unrouted="drop")


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_unrouted_rtn_prunes_an_expert_its_router_never_chose_by_magnitude(method, caplog):
    model = tiny_moe("gpt_oss", layers=2)
    with pytest.raises(ConfigError, match=r"was sent no calibration token by its router"):
        surgery.prune(model, 0.5, method=method, calibration=BATCHES)
    originals = copy.deepcopy(model)
    per_expert = surgery.linear_experts(originals)  # the experts' own layers, unpruned
    with caplog.at_level(logging.WARNING, logger="surgery"):
        handle = surgery.prune(model, 0.5, method=method, calibration=BATCHES, exclude="lm_head", unrouted="rtn")
    try:
        unrouted = handle.sequential.unrouted
        assert unrouted and all(".mlp.experts." in layer for layer in unrouted), unrouted
        said = [r.getMessage() for r in caplog.records if "no calibration input reached it" in r.getMessage()]
        assert len(said) == len(unrouted) and all("pruned by magnitude alone" in line for line in said)
        for layer in unrouted:
            weight = model.get_submodule(layer).weight.detach()
            assert float((weight == 0).float().mean()) == pytest.approx(0.5, abs=0.02), layer
            if method == "wanda":  # every input weighed alike: each row keeps the half of largest magnitude
                original = originals.get_submodule(layer).weight.detach().abs()
                largest = original.topk(original.shape[1] // 2, dim=1).indices
                expected = torch.zeros_like(original, dtype=torch.bool).scatter_(1, largest, True)
                assert torch.equal(weight != 0, expected), layer
        from surgery.cli.steps import STEPS

        report: dict = {}
        STEPS.get("prune").reporting.report(handle, None, None, report)  # the command line's report.json
        assert report["prune"]["unrouted"] == dict.fromkeys(unrouted, "magnitude")
    finally:
        handle.restore()
        per_expert.restore()
