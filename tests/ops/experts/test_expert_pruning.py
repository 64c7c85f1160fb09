"""Removing whole experts: fused parameters, router rows and expert counts shrink together, the
pruned model runs and saves as a smaller model of its family, and restore() is bit for bit."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from surgery.core.errors import AlreadyModifiedError, ConfigError
from surgery.ops.experts.expert_pruning import prune_experts, remove_experts
from surgery.ops.experts.expert_scores import EXPERT_CRITERIA, register_expert_criterion
from surgery.ops.experts.linearizing import linear_experts
from surgery.ops.offload.offloading import offloaded
from surgery.ops.quantization.quantization import quantize
from surgery.ops.sparsity.pruning import prune
from tests.support import tiny_llama, tiny_moe

TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def _snapshot(model: torch.nn.Module) -> dict:
    """Every tensor (by identity and value) and every expert count on modules and config."""
    counts = {
        (name, attr): getattr(module, attr)
        for name, module in model.named_modules()
        for attr in COUNTS
        if isinstance(getattr(module, attr, None), int)
    }
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "ids": {k: id(v) for k, v in model.named_parameters()},
        "counts": counts,
        "config": {k: v for k, v in model.config.to_dict().items() if k in COUNTS},  # save_pretrained sets others
    }


def _same(model: torch.nn.Module, before: dict) -> None:
    after = _snapshot(model)
    assert after["ids"] == before["ids"] and after["counts"] == before["counts"]
    assert after["config"] == before["config"]
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(after["state"][k], v) for k, v in before["state"].items())


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_pruned_model_shrinks_runs_saves_and_restores_bit_for_bit(family: str, tmp_path) -> None:
    model = tiny_moe(family, 2, experts=8, top_k=2)
    before = _snapshot(model)
    handle = prune_experts(model, 0.5, calibration=[TOKENS])
    block = model.model.layers[1].mlp
    router = getattr(block, "gate", None) or block.router
    assert block.experts.gate_up_proj.shape[0] == 4 and block.experts.down_proj.shape[0] == 4
    assert router.weight.shape[0] == 4 and block.experts.num_experts == router.num_experts == 4
    assert handle.num_experts == {"before": 8, "after": 4}
    kept = handle.kept["model.layers.1.mlp.experts"]
    assert torch.equal(block.experts.down_proj, before["state"]["model.layers.1.mlp.experts.down_proj"][kept])
    with torch.no_grad():
        logits = model(TOKENS).logits
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, logits)
    handle.restore()
    _same(model, before)


def test_router_bias_and_score_correction_rows_follow_the_experts() -> None:
    model = tiny_moe("deepseek_v3", 1, experts=8, top_k=2)
    gate = model.model.layers[0].mlp.gate
    gate.e_score_correction_bias.copy_(torch.arange(8.0))
    handle = prune_experts(model, 4, calibration=[TOKENS])
    assert gate.e_score_correction_bias.tolist() == [float(e) for e in handle.kept["model.layers.0.mlp.experts"]]
    oss = tiny_moe("gpt_oss", 1, experts=4, top_k=2)
    bias = oss.model.layers[0].mlp.router.bias.detach().clone()
    kept = prune_experts(oss, 1, calibration=[TOKENS]).kept["model.layers.0.mlp.experts"]
    assert torch.equal(oss.model.layers[0].mlp.router.bias, bias[kept])
    assert oss.model.layers[0].mlp.experts.down_proj_bias.shape[0] == 3


@pytest.mark.parametrize(
    ("family", "amount", "message"),
    [
        ("mixtral", 3, "leaves 1 expert per layer, fewer than the top_k=2"),
        ("mixtral", 0.0, "between 1 and 3"),
        ("mixtral", 1.5, "fraction in (0, 1)"),
        ("mixtral", "half", "fraction in (0, 1)"),
        ("deepseek_v3", 2, "leaves 3 experts per layer, which do not split into n_group=2"),
        ("phimoe", 1, "no router kind known"),
    ],
)
def test_refusals_are_one_line_and_leave_the_model_as_it_was(family: str, amount: object, message: str) -> None:
    model = tiny_moe(family, 1, experts=4 if family != "deepseek_v3" else 8, top_k=2)
    before = _snapshot(model)
    if family == "deepseek_v3":
        amount = 5  # 3 left: not 2 groups of 2 or more
    with pytest.raises(ConfigError, match="prune_experts") as err:
        prune_experts(model, amount, calibration=[TOKENS])
    assert message in str(err.value) and "\n" not in str(err.value)
    _same(model, before)


def test_refused_without_experts_without_calibration_or_under_other_surgery() -> None:
    with pytest.raises(ConfigError, match="no mixture-of-experts layer"):
        prune_experts(tiny_llama(), 0.5, calibration=[TOKENS])
    model = tiny_moe("qwen3_moe", 1, experts=4, top_k=2)
    with pytest.raises(ConfigError, match="needs calibration batches"):
        prune_experts(model, 1, criterion="reap")
    with linear_experts(model), pytest.raises(ConfigError, match="restore or bake it first"):
        prune_experts(model, 1, calibration=[TOKENS])
    with prune(model, 0.5), pytest.raises(ConfigError, match="restore or bake it first"):
        prune_experts(model, 1, calibration=[TOKENS])


def test_restore_is_refused_while_a_later_handle_holds_the_experts_left() -> None:
    model = tiny_moe("qwen3_moe", 1, experts=4, top_k=2)
    before = _snapshot(model)
    first = prune_experts(model, 1, calibration=[TOKENS])
    for verb in (lambda: prune_experts(model, 1, calibration=[TOKENS]), lambda: quantize(model)):
        later = verb()
        middle = _snapshot(model)
        with pytest.raises(AlreadyModifiedError, match=f"{later.kind} was applied after it"):
            first.restore()
        _same(model, middle)
        later.restore()
    first.restore()
    _same(model, before)


def test_empty_calibration_and_a_bad_seed_are_refused() -> None:
    model = tiny_moe("qwen3_moe", 1, experts=4, top_k=2)
    before = _snapshot(model)
    with pytest.raises(ConfigError, match="prune_experts.calibration='0 batches': must hold at least one batch"):
        prune_experts(model, 1, calibration=[])
    with pytest.raises(ConfigError, match="prune_experts.seed='x': must be an integer"):
        prune_experts(model, 1, criterion="random", seed="x")
    _same(model, before)


def test_a_grouped_router_loses_as_many_experts_from_each_group() -> None:
    model = tiny_moe("deepseek_v3", 1, experts=8, top_k=2)  # n_group=2, topk_group=1: groups 0-3 and 4-7
    gate, name = model.model.layers[0].mlp.gate, "model.layers.0.mlp.experts"
    register_expert_criterion("index_order", lambda stats: torch.arange(stats.num_experts, dtype=torch.float64))
    try:
        handle = prune_experts(model, 2, calibration=[TOKENS], criterion="index_order")
    finally:
        EXPERT_CRITERIA.unregister("index_order")
    assert handle.removed[name] == [0, 4]  # not 0 and 1: experts 4 and 5 would move into group 0
    hidden = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        after = torch.tensor(handle.kept[name])[gate(hidden)[2]].sort(-1).values
        handle.restore()
        chosen = gate(hidden)[2].sort(-1).values
    untouched = ~torch.isin(chosen, torch.tensor([0, 4])).any(-1)
    assert untouched.any() and torch.equal(after[untouched], chosen[untouched])
    with pytest.raises(ConfigError, match=re.escape("keeps [2, 4] experts from the n_group=2 groups of 4")):
        remove_experts(model, {name: [2, 3, 4, 5, 6, 7]})


def test_repeated_kept_indices_count_once() -> None:
    model = tiny_moe("qwen3_moe", 1, experts=4, top_k=2)
    handle = remove_experts(model, {"model.layers.0.mlp.experts": [0, 0, 1, 2]})
    assert handle.num_experts == {"before": 4, "after": 3} and model.config.num_experts == 3
    with torch.no_grad():
        assert model(TOKENS).logits.isfinite().all()
    handle.restore()


def test_an_offloaded_model_or_its_skeleton_is_refused_in_one_line(tmp_path) -> None:
    tiny_moe("qwen3_moe", 1, experts=4, top_k=2).save_pretrained(tmp_path)
    with offloaded(tmp_path) as handle:
        with pytest.raises(ConfigError, match="^prune_experts='an offloaded model': works on a model in memory"):
            prune_experts(handle, 1, calibration=[TOKENS])
        with pytest.raises(ConfigError, match="gate_up_proj': is on the meta device"):
            prune_experts(handle.model, 1, calibration=[TOKENS])
        with torch.no_grad():
            assert handle.model(TOKENS).logits.isfinite().all()  # the skeleton still runs, whole


def test_restore_after_the_model_moved_to_another_dtype_follows_it() -> None:
    model = tiny_moe("deepseek_v3", 1, experts=8, top_k=2)  # e_score_correction_bias: a buffer
    gate = model.model.layers[0].mlp.gate
    before = {"weight": gate.weight, "rows": gate.weight.detach().clone()}
    handle = prune_experts(model, 2, calibration=[TOKENS])
    model.to(torch.bfloat16)
    handle.restore()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert gate.e_score_correction_bias.dtype == torch.bfloat16
    assert gate.weight is before["weight"] and torch.equal(gate.weight, before["rows"].to(torch.bfloat16))
    with torch.no_grad():
        assert model(TOKENS).logits.isfinite().all()
