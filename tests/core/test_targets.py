"""What prune and quantize work on: any floating parameter by name, GPT-2's Conv1D as a
linear layer, and every weight left out reported with the reason (never silently)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import surgery
from surgery import GridSpec
from surgery.core.targets import select_parameters


class Mixed(nn.Module):
    """An LSTM, attention (in_proj_weight read by F.multi_head_attention_forward), an embedding
    tied to the head, and a Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        x = self.lstm(x)[0]
        x = self.attn(x, x, x, need_weights=False)[0]
        return self.head(self.proj(x))


@pytest.fixture
def mixed() -> Mixed:
    return Mixed().eval()


IDS = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(1))


def test_the_default_selection_reports_each_layer_it_leaves_out_and_why(mixed, caplog):
    with caplog.at_level(logging.DEBUG, logger="surgery"):
        handle = surgery.prune(mixed, 0.5)
    assert handle.parameters == ["attn.out_proj.weight", "proj.weight"]
    skipped = {s.name: s.reason for s in handle.skipped}
    assert "select 'lstm.weight_ih_l0'" in skipped["lstm"]
    assert "in_proj_weight" in skipped["attn"]
    assert "same tensor as the input embedding embed" in skipped["head.weight"]
    assert "not in the default selection" in skipped["embed"]
    assert "prune: 2 parameter(s) matched" in caplog.text and "skipped lstm (LSTM)" in caplog.text
    handle.restore()


def test_a_head_tied_to_the_input_embedding_is_left_out_by_default_with_one_warning(mixed, caplog):
    """Before: the head was pruned by default, and the embedding with it, said only in skipped."""
    embedding = mixed.embed.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="surgery"):
        pruned = surgery.prune(mixed, 0.5)
        quantized = surgery.quantize(mixed, weights=GridSpec(bits=4))
    assert torch.equal(mixed.embed.weight, embedding)
    assert "head.weight" not in pruned.parameters and "head.weight" not in quantized.weights
    warnings = [r for r in caplog.records if "tied output head" in r.getMessage()]
    assert [r.getMessage().split(":")[0] for r in warnings] == ["prune", "quantize"]  # one each, naming it
    assert all("head left out" in r.getMessage() for r in warnings)
    quantized.restore()
    pruned.restore()


def test_a_tied_head_selected_explicitly_is_pruned_with_its_embedding(mixed):
    with surgery.prune(mixed, 0.5, select="head") as handle:
        assert handle.parameters == ["head.weight"]
        assert (mixed.embed.weight == 0).float().mean().item() == pytest.approx(0.5)


def test_any_floating_parameter_can_be_pruned_by_qualified_name(mixed):
    before = {k: v.clone() for k, v in mixed.state_dict().items()}
    reference = mixed(IDS)
    with surgery.prune(mixed, 0.5, select=["**.weight_ih_l0", "attn.in_proj_weight"]) as handle:
        assert handle.parameters == ["lstm.weight_ih_l0", "attn.in_proj_weight"]
        assert handle.sparsity() == pytest.approx(0.5)
        assert (mixed.lstm.weight_ih_l0 == 0).float().mean() == pytest.approx(0.5)
        assert (mixed.attn.in_proj_weight == 0).float().mean() == pytest.approx(0.5)
        assert not torch.equal(mixed(IDS), reference)  # attention reads in_proj_weight itself: zeros in place
    assert all(torch.equal(before[k], v) for k, v in mixed.state_dict().items())


def test_quantize_can_target_a_parameter_by_name_per_output_row(mixed):
    with surgery.quantize(
        mixed, weights=GridSpec(bits=4, symmetric=True, per_channel=True), select="lstm.weight_hh_l0"
    ) as handle:
        assert list(handle.weights) == ["lstm.weight_hh_l0"]
        assert handle.weights["lstm.weight_hh_l0"].axis == 0
        rows = mixed.lstm.weight_hh_l0
        assert all(len(torch.unique(row)) <= 16 for row in rows)  # 4 bits per row


def test_quantize_raises_on_a_selection_without_weights_like_prune(mixed):
    for verb in (lambda: surgery.quantize(mixed, select=nn.LSTM), lambda: surgery.prune(mixed, 0.5, select=nn.LSTM)):
        with pytest.raises(surgery.ConfigError, match="selects no floating weight.*'\\*\\*.weight_ih_l0'"):
            verb()


def test_activation_quantization_without_weights_in_the_selection_still_works(mixed):
    """Weights skipped (ReLU-like layers have none) are reported; activations are still quantized."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with surgery.quantize(
        model, activations=GridSpec(), select="1", calibration=[torch.randn(3, 4)], progress=False
    ) as handle:
        assert list(handle.activations) == ["1"] and handle.weights == {}


def test_a_pattern_matching_neither_module_nor_parameter_names_both(mixed):
    with pytest.raises(surgery.SelectionError, match="'\\*\\*.weight_ih_l9': matches no module or parameter"):
        surgery.prune(mixed, 0.5, select="**.weight_ih_l9")


def test_excluding_a_weight_by_its_parameter_name_beats_the_default_selection(mixed):
    with surgery.prune(mixed, 0.5, exclude="proj.weight") as handle:
        assert "proj.weight" not in handle.parameters and "attn.out_proj.weight" in handle.parameters
        assert (mixed.proj.weight != 0).all()


def test_excluding_a_layer_excludes_its_parameters_named_directly(mixed):
    with pytest.raises(surgery.ConfigError, match="selects no floating weight"):
        surgery.prune(mixed, 0.5, select="lstm.weight_ih_l0", exclude="lstm")


def test_a_glob_that_stops_at_containers_says_how_to_reach_the_layers_inside():
    import torchvision

    with pytest.raises(surgery.ConfigError, match=r"hold no parameters of their own, e.g. layer1.0: 'layer1.0.\*\*'"):
        surgery.prune(torchvision.models.resnet18(), 0.3, select="layer1.*")


def test_a_timm_vision_transformer_by_dotted_globs():
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32).eval()
    with surgery.prune(model, 0.3, select="blocks.**", exclude="**.attn.**") as handle:
        assert len(handle.parameters) == 24 and all(".mlp.fc" in name for name in handle.parameters)
    with surgery.prune(model, 0.3) as handle:
        assert len(handle.parameters) == 50  # qkv, proj, fc1, fc2 of 12 blocks, patch_embed, head
        [root] = handle.skipped  # pos_embed and cls_token live on the root: named, with how to select them
        assert root.type == "VisionTransformer" and "select 'cls_token'" in root.reason


transformers = pytest.importorskip("transformers")

from support import tiny_gpt2  # tests/support.py  # noqa: E402


def test_gpt2_conv1d_is_pruned_and_quantized_as_a_linear_layer():
    """Before: GPT-2's Conv1D (a transposed Linear) was silently left out of the default selection."""
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    reference = model(input_ids=ids).logits
    with surgery.prune(model, 0.5) as pruned:
        assert "transformer.h.0.attn.c_attn.weight" in pruned.parameters
        assert sum("mlp.c_fc" in name for name in pruned.parameters) == 2
        assert pruned.sparsity() == pytest.approx(0.5, abs=1e-4)
        assert "lm_head.weight" not in pruned.parameters
        assert any(s.name == "lm_head.weight" and "input embedding transformer.wte" in s.reason for s in pruned.skipped)
    assert torch.equal(model(input_ids=ids).logits, reference)
    with surgery.quantize(model, weights=GridSpec(bits=4, symmetric=True, per_channel=True)) as quantized:
        c_fc = model.transformer.h[0].mlp.c_fc
        assert quantized.weights["transformer.h.0.mlp.c_fc.weight"].axis == 1  # (in, out): out is axis 1
        columns = c_fc.weight.t()
        assert all(len(torch.unique(column)) <= 16 for column in columns)
    assert torch.equal(model(input_ids=ids).logits, reference)


def test_an_intercept_rule_that_never_fires_on_a_hugging_face_model_warns():
    """GPT-2's GELU is transformers' own class: swapping nn.GELU fires nowhere."""
    with pytest.warns(surgery.RuleNeverFiredWarning, match=r"swap\(GELU\) never fired"):
        with surgery.intercept(surgery.rules.swap(nn.GELU, lambda old: nn.ReLU())) as log:
            tiny_gpt2()
    assert len(log) == 0
    with pytest.raises(surgery.RuleNeverFiredError, match=r"swap\(GELU\) never fired"):
        with surgery.intercept(surgery.rules.swap(nn.GELU, lambda old: nn.ReLU()), strict=True):
            tiny_gpt2()


def test_an_excluded_layer_is_reported_as_excluded_not_as_outside_the_default():
    from torch import nn

    import surgery

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    handle = surgery.prune(model, 0.5, exclude="2", progress=False)
    assert [(s.name, s.reason) for s in handle.skipped] == [("2", "excluded (prune.exclude)")]
    handle.restore()


class WithPositions(nn.Module):
    """A model holding a parameter of its own (as a ViT's position embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Parameter(torch.randn(4, 8))
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.positions)


def test_the_model_itself_skipped_is_named_by_its_parameters_not_an_empty_name():
    model = WithPositions()
    with surgery.prune(model, 0.5) as handle:
        assert [s.name for s in handle.skipped] == ["positions"]


@pytest.mark.parametrize(
    ("family", "routers"),
    [
        ("mixtral", ["model.layers.0.mlp.gate"]),  # a raw weight
        ("phimoe", ["model.layers.0.mlp.router.weight"]),  # an nn.Linear subclass
        ("qwen2_moe", ["model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate.weight"]),
    ],
)
def test_routers_stay_float_unless_a_pattern_names_them(family, routers):
    from tests.support import tiny_moe

    model = tiny_moe(family)
    found = select_parameters(model, None, None, verb="prune")
    left = {item.name: item.reason for item in found.skipped}
    for router in routers:
        assert "router of a mixture-of-experts layer" in left[router], router
        assert router not in found.matched
    layers = [router.removesuffix(".weight") for router in routers]
    named = select_parameters(model, ["**.self_attn.*", *layers], None, verb="prune")
    for layer in layers:
        assert f"{layer}.weight" in named.matched, layer


def test_coverage_counts_each_tensor_once_and_names_the_largest_left():
    from tests.support import tiny_moe

    model = tiny_moe("qwen3_moe")
    coverage = select_parameters(model, None, None, verb="quantize").coverage
    total = sum(p.numel() for p in model.parameters())
    attention = sum(p.numel() for n, p in model.named_parameters() if "self_attn" in n and p.dim() == 2)
    head = model.lm_head.weight.numel()
    assert coverage.total_params == total
    assert coverage.changed_params == attention + head
    assert coverage.largest_left[0].name == "model.layers.0.mlp.experts.gate_up_proj"
    assert "not in the default selection" in coverage.largest_left[0].reason
    assert coverage.left_share > 0.5  # the fused experts: most of the weight bytes

    excluded = select_parameters(model, None, ["model.layers.0.mlp.experts", "model.embed_tokens"], verb="quantize")
    assert excluded.coverage.left_weight_bytes < 0.02 * excluded.coverage.weight_bytes  # the router only
    assert excluded.coverage.largest_left[0].reason == "excluded (exclude=)"


def test_a_pattern_naming_layers_and_other_layers_weights_takes_the_layers_and_says_so(caplog):
    """DeepSeek-V3: `experts.down_proj` is a fused tensor of the routed experts (per-expert layers
    while a verb runs, which the pattern then names too) and `shared_experts.down_proj` a Linear."""
    from tests.support import tiny_moe

    model = tiny_moe("deepseek_v3", layers=2)
    with surgery.prune(model, 0.5, select=r"re:.*experts\.down_proj$") as handle:
        matched = set(handle.selection.matched)
    routed = {f"model.layers.{i}.mlp.experts.{e}.down_proj.weight" for i in range(2) for e in range(4)}
    shared = {f"model.layers.{i}.mlp.shared_experts.down_proj.weight" for i in range(2)}
    assert matched == routed | shared

    with caplog.at_level(logging.WARNING, logger="surgery"):
        fused = select_parameters(model, [r"re:.*experts\.down_proj$"], None, verb="prune")  # no verb: still fused
    assert set(fused.matched) == shared
    assert "also 2 weight(s) of other layers (model.layers.0.mlp.experts.down_proj" in caplog.text
