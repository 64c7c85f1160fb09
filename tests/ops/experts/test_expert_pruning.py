"""Removing whole experts: fused parameters, router rows and expert counts shrink together, the
pruned model runs and saves as a smaller model of its family, and restore() is bit for bit."""

from __future__ import annotations

import pytest
import torch
import transformers

from surgery.core.errors import ConfigError
from surgery.ops.experts.expert_pruning import prune_experts
from surgery.ops.experts.linearizing import linear_experts
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
        ("mixtral", 3, "leaves 1 experts per layer, fewer than the top_k=2"),
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
