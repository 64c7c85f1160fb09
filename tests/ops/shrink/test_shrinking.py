"""surgery.shrink / surgery.rebuild: coupled channels removed for real, restorably, rebuilt strictly."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import pytest
import torch
import torchvision
from support import tiny_llama  # tests/support.py
from torch import nn

import surgery
from surgery.core.errors import ConfigError
from surgery.testing import assert_no_hooks, snapshot, snapshot_differences


def with_statistics(model: nn.Module) -> nn.Module:
    """Non-trivial batch-norm statistics, so a wrongly sliced norm shows in the outputs."""
    torch.manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_(0, 0.1)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.normal_(1.0, 0.1)
                module.bias.normal_(0.0, 0.1)
    return model.eval()


def masked_like(original: nn.Module, handle) -> nn.Module:
    """The original model with every removed input channel's weights zeroed in the layers that
    read it: removing a channel must compute exactly this."""
    masked = copy.deepcopy(original)
    named = dict(masked.named_modules())
    with torch.no_grad():
        for name, (keep_in, _) in handle.kept.items():
            module = named[name]
            reads = isinstance(module, nn.Linear) or (isinstance(module, nn.Conv2d) and module.groups == 1)
            if keep_in is not None and reads:
                drop = torch.ones(module.weight.shape[1], dtype=torch.bool)
                drop[keep_in] = False
                module.weight[:, drop] = 0
    return masked


@pytest.mark.parametrize(
    "name",
    [
        "resnet18",
        "mobilenet_v3_small",
        "densenet121",
        "shufflenet_v2_x0_5",
        "efficientnet_b0",
        "regnet_x_400mf",
        "resnext50_32x4d",
    ],
)
def test_removing_channels_computes_what_zeroing_their_readers_computes(name):
    torch.manual_seed(0)
    model = with_statistics(torchvision.models.get_model(name, weights=None, num_classes=10))
    original = copy.deepcopy(model)
    x = torch.randn(2, 3, 64, 64)
    before = snapshot(model)
    handle = surgery.shrink(model, 0.4, calibration=x)
    assert handle.params()["after"] < 0.8 * handle.params()["before"]  # >= 20 % removed at 0.4
    assert handle.macs()["after"] < handle.macs()["before"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), masked_like(original, handle)(x), rtol=1e-4, atol=1e-5)
    handle.restore()
    assert snapshot_differences(before, snapshot(model)) == []
    assert_no_hooks(model)


class GroupedBlock(nn.Module):
    """Group norm and a grouped (not depthwise) convolution: channels go in whole groups."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.norm = nn.GroupNorm(4, 16)
        self.grouped = nn.Conv2d(16, 24, 3, padding=1, groups=4)
        self.head = nn.Linear(24, 5)

    def forward(self, x):
        return self.head(self.grouped(torch.relu(self.norm(self.stem(x)))).mean(dim=(2, 3)))


def test_group_norm_and_grouped_convolutions_lose_whole_groups():
    torch.manual_seed(0)
    model = GroupedBlock().eval()
    with torch.no_grad():
        model.norm.weight.normal_(1.0, 0.2)
        model.norm.bias.normal_(0.0, 0.2)
    original = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8)
    handle = surgery.shrink(model, 0.5, calibration=x)
    assert (model.norm.num_groups, model.norm.num_channels) == (2, 8)
    assert (model.grouped.groups, model.grouped.in_channels, model.grouped.out_channels) == (2, 8, 12)
    kept = handle.kept["stem"][1].tolist()
    assert all(kept[i] // 4 == kept[i - i % 4] // 4 for i in range(len(kept)))  # whole groups of 4
    with torch.no_grad():
        torch.testing.assert_close(model(x), masked_like(original, handle)(x), rtol=1e-4, atol=1e-5)
    fresh = surgery.rebuild(GroupedBlock, json.loads(json.dumps(handle.structure())))
    baked = handle.bake()
    fresh.load_state_dict(baked.state_dict(), strict=True)
    assert torch.equal(fresh.eval()(x), baked(x))


def test_restore_puts_back_the_same_module_objects_and_amount_zero_changes_nothing():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    objects = dict(model.named_modules())
    x = torch.randn(1, 3, 32, 32)
    reference = model(x)
    untouched = surgery.shrink(model, 0.0, calibration=x)
    assert untouched.replaced == {} and torch.equal(model(x), reference)
    handle = surgery.shrink(model, 0.5, calibration=x)
    assert model.layer1[0].conv1 is not objects["layer1.0.conv1"]
    handle.restore()
    assert all(module is objects[name] for name, module in model.named_modules())
    assert torch.equal(model(x), reference)


@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v3_large", "swin_t", "convnext_tiny"])
def test_bake_rebuild_strict_load_gives_identical_outputs(name):
    """convnext_tiny: LayerNorm2d (a subclass) stays itself, and each block's layer scale (a loose
    parameter multiplying the residual branch) is sliced with the channels it scales."""
    torch.manual_seed(0)
    model = with_statistics(torchvision.models.get_model(name, weights=None, num_classes=10))
    size = 224 if name == "swin_t" else 64
    x = torch.randn(1, 3, size, size)
    handle = surgery.shrink(model, 0.5, calibration=x)
    plan = json.loads(json.dumps(handle.structure()))  # JSON-serialisable
    baked = handle.bake()
    assert_no_hooks(baked)
    fresh = surgery.rebuild(lambda: torchvision.models.get_model(name, weights=None, num_classes=10), plan)
    fresh.load_state_dict(baked.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(x), baked(x))
    if name == "convnext_tiny":
        assert type(baked.features[0][1]).__name__ == "LayerNorm2d"
        assert plan["features.1.0"]["parameters"]["layer_scale"][0] < 96  # the stage's width shrank
        assert 1 - handle.params()["after"] / handle.params()["before"] > 0.6  # residual streams shrink too


class Odd(nn.Module):
    """A layer called twice, a dict output, a frozen parameter and a channel concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.shared = nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(3, 4, 1)
        self.head = nn.Linear(20, 5)
        self.a.weight.requires_grad_(False)

    def forward(self, x):
        y = torch.relu(self.shared(torch.relu(self.shared(torch.relu(self.a(x))))))
        z = torch.cat([y, self.b(x), y[:, :8]], dim=1)  # a slice: unknown to the trace, its channels stay
        return {"logits": self.head(z.mean(dim=(2, 3))), "features": y}


def test_shared_layers_dict_outputs_frozen_weights_and_slices_are_handled_safely():
    torch.manual_seed(0)
    model = Odd().eval()
    x = torch.randn(2, 3, 8, 8)
    reference = model(x)
    handle = surgery.shrink(model, 0.5, calibration=x)
    out = model(x)
    assert {k: v.shape for k, v in out.items()} == {k: v.shape for k, v in reference.items()}
    assert handle.frozen_ops == ["__getitem__"]  # the slice froze what it touched: a's and shared's channels
    families = {tuple(f["layers"]): (f["removed"], f["frozen"]) for f in handle.families}
    assert families[("a", "shared")] == (0, 8)  # shared runs on a's outputs and on its own: one family
    assert families[("b",)] == (2, 0)
    assert handle.kept["head"][0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    handle.restore()
    assert all(torch.equal(model(x)[k], reference[k]) for k in reference)


def test_round_to_keeps_channel_counts_multiples():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    handle = surgery.shrink(model, 0.3, calibration=torch.randn(1, 3, 32, 32), round_to=8)
    widths = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert all(w % 8 == 0 for w in widths) and handle.replaced
    handle.restore()


def _bert():
    import transformers

    return transformers.BertModel(
        transformers.BertConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            vocab_size=64,
            max_position_embeddings=32,
            attn_implementation="eager",
        )
    )


def _hf_vit():
    import transformers

    return transformers.ViTForImageClassification(
        transformers.ViTConfig(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            num_labels=5,
        )
    )


def _llama_grouped_heads():

    return tiny_llama(layers=2, vocab=64, hidden=32, heads=8).train()  # as built: the test sets its mode


def _timm_vit():
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2, num_classes=5)


HEAD_MODELS = {  # factory, example inputs, attention module, its head-count attributes at 0.5, heads kept
    "bert": (
        _bert,
        lambda: {"input_ids": torch.randint(0, 64, (2, 16))},
        "encoder.layer.0.attention.self",
        {"num_attention_heads": 2, "all_head_size": 16},
        2 / 4,
    ),
    "hf_vit": (
        _hf_vit,
        lambda: {"pixel_values": torch.randn(2, 3, 32, 32)},
        "vit.layers.0.attention",
        {"num_attention_heads": 2},
        2 / 4,
    ),
    "llama_gqa": (
        _llama_grouped_heads,
        lambda: {"input_ids": torch.randint(0, 64, (2, 16))},
        "model.layers.0.self_attn",
        {},
        1 / 2,
    ),  # 2 key/value groups of 4 query heads: one group goes
    "timm_vit": (
        _timm_vit,
        lambda: torch.randn(2, 3, 32, 32),
        "blocks.0.attn",
        {"num_heads": 2, "attn_dim": 128},
        2 / 3,
    ),  # 3 heads: floor(1.5) = 1 removed
}


def _logits(model, example):
    out = model(**example) if isinstance(example, dict) else model(example)
    for key in ("logits", "last_hidden_state"):
        if hasattr(out, key):
            return getattr(out, key)
    return out


@pytest.mark.parametrize("name", list(HEAD_MODELS))
def test_whole_attention_heads_are_removed_and_the_model_rebuilds(name):
    """Removing heads computes what zeroing their columns in the output projection computes;
    the head-count attributes follow, restore is exact, and the plan rebuilds the class."""
    pytest.importorskip("transformers")
    pytest.importorskip("timm")
    factory, example_of, attention, attributes, kept = HEAD_MODELS[name]
    torch.manual_seed(0)
    model = factory().eval()
    example = example_of()
    original = copy.deepcopy(model)
    before = snapshot(model)
    reference = _logits(model, example)
    handle = surgery.shrink(model, 0.5, calibration=example)
    module = model.get_submodule(attention)
    assert {attr: getattr(module, attr) for attr in attributes} == attributes
    assert handle.structure().get(attention, {}).get("attributes", {}) == attributes
    layout = surgery.ops.shrink.heads.layout_of(module)
    rows = {p: getattr(module, p).out_features for p in layout.projections}
    full = {p: getattr(original.get_submodule(attention), p).out_features for p in layout.projections}
    assert all(rows[p] == full[p] * kept for p in rows)  # the same heads in every projection (GQA: whole groups)
    with torch.no_grad():
        shrunk = _logits(model, example)
        torch.testing.assert_close(shrunk, _logits(masked_like(original, handle), example), rtol=1e-4, atol=1e-5)
    plan = json.loads(json.dumps(handle.structure()))
    baked = handle.bake()
    fresh = surgery.rebuild(factory, plan).eval()
    fresh.load_state_dict(baked.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(_logits(fresh, example), _logits(baked, example))
    restored = factory().eval()
    restored.load_state_dict(original.state_dict())
    again = surgery.shrink(restored, 0.5, calibration=example)
    again.restore()
    assert snapshot_differences(snapshot(original), snapshot(restored)) == []
    assert torch.equal(_logits(restored, example), reference)
    assert before  # the snapshot of the model before shrinking was taken


def test_embeddings_and_the_pooler_slice_let_bert_lose_hidden_width_but_tied_weights_stay():
    """BertForSequenceClassification: the word/position/type embeddings produce the hidden
    stream, the pooler reads ``hidden[:, 0]``: the whole stream shrinks. BertForMaskedLM ties its
    decoder to the word embeddings: that stream stays, the tie survives rebuild."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=32,
    )
    ids = {"input_ids": torch.randint(0, 64, (2, 16))}
    for cls, width in ((transformers.BertForSequenceClassification, 16), (transformers.BertForMaskedLM, 32)):
        torch.manual_seed(0)
        model = cls(config).eval()
        reference = model(**ids).logits
        handle = surgery.shrink(model, 0.5, calibration=ids)
        assert model.bert.embeddings.word_embeddings.embedding_dim == width
        assert model.bert.encoder.layer[1].output.LayerNorm.normalized_shape == (width,)
        assert model.bert.encoder.layer[0].attention.self.num_attention_heads == 2
        assert model(**ids).logits.shape == reference.shape
        plan = json.loads(json.dumps(handle.structure()))
        baked = handle.bake()
        fresh = surgery.rebuild(lambda cls=cls: cls(config), plan).eval()
        fresh.load_state_dict(baked.state_dict(), strict=True)
        assert torch.equal(fresh(**ids).logits, baked(**ids).logits)
        if cls is transformers.BertForMaskedLM:
            assert fresh.cls.predictions.decoder.weight is fresh.bert.embeddings.word_embeddings.weight


class TinyAttention(nn.Module):
    """An attention module of our own: its heads are unknown to shrink until registered."""

    def __init__(self, dim: int = 16, heads: int = 4, hard_coded: bool = False) -> None:
        super().__init__()
        self.n_heads, self.size, self.hard_coded, self.dim = heads, dim // heads, hard_coded, dim
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.size).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = torch.softmax(q @ k.transpose(-1, -2) / self.size**0.5, dim=-1) @ v
        width = self.dim if self.hard_coded else self.n_heads * self.size  # a hard-coded width breaks shrinking
        return self.out(y.transpose(1, 2).reshape(b, t, width))


def test_unregistered_attention_keeps_its_heads_until_its_layout_is_registered():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), TinyAttention(), nn.Linear(16, 3)).eval()
    x = torch.randn(2, 5, 8)
    reference = model(x)
    handle = surgery.shrink(model, 0.5, calibration=x)
    assert model[1].q.out_features == 16 and model[1].n_heads == 4  # the reshapes froze the heads
    assert model[1].q.in_features == 8  # what the first layer feeds it still shrinks
    handle.restore()
    surgery.register_heads(
        TinyAttention, surgery.HeadLayout(("q", "k", "v"), "size", heads={"n_heads": "q"}, output="out")
    )
    try:
        handle = surgery.shrink(model, 0.5, calibration=x)
        assert model[1].n_heads == 2 and model[1].q.out_features == 8 and model[1].out.in_features == 8
        assert model(x).shape == reference.shape
        handle.restore()
        assert model[1].n_heads == 4 and torch.equal(model(x), reference)
    finally:
        surgery.ops.shrink.heads.unregister_heads(TinyAttention)


def test_a_module_that_fails_once_shrunk_is_kept_whole_and_the_rest_still_shrinks():
    """A registered layout that misses a hard-coded width: the check forward fails inside the
    attention, which is then kept whole (heads and inputs); the layers after it still shrink."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), TinyAttention(hard_coded=True), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3)
    ).eval()
    x = torch.randn(2, 5, 8)
    reference = model(x)
    surgery.register_heads(
        TinyAttention, surgery.HeadLayout(("q", "k", "v"), "size", heads={"n_heads": "q"}, output="out")
    )
    try:
        handle = surgery.shrink(model, 0.5, calibration=x)
    finally:
        surgery.ops.shrink.heads.unregister_heads(TinyAttention)
    assert "1 (fails when its channels shrink: kept whole)" in handle.frozen_ops
    assert model[1].n_heads == 4 and model[1].q.in_features == 16 and model[2].out_features == 16
    assert model(x).shape == reference.shape
    handle.restore()
    assert torch.equal(model(x), reference)
    assert_no_hooks(model)


class HardCoded(nn.Module):
    """Its own forward reshapes by a fixed width: only keeping the whole model avoids the failure."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).view(x.shape[0], 8))


def test_when_only_the_whole_model_can_be_kept_nothing_is_removed_and_it_says_so(caplog):
    model = HardCoded().eval()
    x = torch.randn(2, 4)
    before = snapshot(model)
    handle = surgery.shrink(model, 0.5, calibration=x)
    assert handle.replaced == {} and "the model (fails when its channels shrink: kept whole)" in handle.frozen_ops
    assert "shrink: nothing removed" in caplog.text
    assert snapshot_differences(before, snapshot(model)) == []


def test_importance_by_registered_name_and_bad_scores_are_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    with torch.no_grad():
        model[0].weight.copy_(torch.arange(32.0).reshape(8, 4))
    x = torch.randn(2, 4)
    surgery.register_importance("reverse_l2", lambda w: -w.norm(dim=1))
    try:
        handle = surgery.shrink(model, 0.5, calibration=x, importance="reverse_l2")
        assert handle.kept["0"][1].tolist() == [0, 1, 2, 3]  # the largest rows scored lowest: removed
        handle.restore()
    finally:
        surgery.ops.shrink.shrinking.IMPORTANCE.unregister("reverse_l2")
    handle = surgery.shrink(model, 0.5, calibration=x, importance="l1")
    assert handle.kept["0"][1].tolist() == [4, 5, 6, 7]
    handle.restore()
    before = snapshot(model)
    with pytest.raises(ConfigError, match="one finite score per output channel of 0"):
        surgery.shrink(model, 0.5, calibration=x, importance=lambda w: w.sum(dim=1) * float("nan"))
    with pytest.raises(ConfigError, match="must give one finite score per output channel of 0 .8.; got 32 values"):
        surgery.shrink(model, 0.5, calibration=x, importance=lambda w: w)
    assert snapshot_differences(before, snapshot(model)) == []


def test_rebuild_refuses_a_factory_that_builds_another_model_each_time():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    plan = surgery.shrink(model, 0.5, calibration=torch.randn(2, 4)).structure()
    builds = iter([[], [nn.Dropout()]])  # the second build attaches one more module: the order shifts
    with pytest.raises(surgery.ShrinkError, match="2 does not have its planned shape"):
        surgery.rebuild(lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), *next(builds), nn.Linear(8, 3)), plan)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"amount": 1.5}, "shrink.amount=1.5"),
        ({"amount": 0.5, "scope": "all"}, "shrink.scope='all'"),
        ({"amount": 0.5, "round_to": 0}, "shrink.round_to=0"),
        ({"amount": 0.5, "importance": "l7"}, "shrink.importance='l7'"),
    ],
)
def test_bad_settings_raise_one_line_and_change_nothing(kwargs, field):
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    before = snapshot(model)
    with pytest.raises(ConfigError) as caught:
        surgery.shrink(model, calibration=torch.randn(1, 3, 32, 32), **kwargs)
    assert str(caught.value).startswith(field)
    assert snapshot_differences(before, snapshot(model)) == []


def test_shrinking_a_pruned_model_and_a_wrong_plan_are_refused():
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    pruned = surgery.prune(model, 0.5, progress=False)
    with pytest.raises(ConfigError, match="has surgery attached"):
        surgery.shrink(model, 0.5, calibration=torch.randn(1, 3, 32, 32))
    pruned.restore()
    plan = {
        "layer1.0.conv1": {"class": "torch.nn.modules.linear.Linear", "args": {"in_features": 2, "out_features": 2}}
    }
    with pytest.raises(ConfigError, match="rebuild.plan='layer1.0.conv1': is a Conv2d in this model"):
        surgery.rebuild(lambda: torchvision.models.resnet18(weights=None, num_classes=10), plan)


def test_a_shrink_that_removes_nothing_says_so(caplog):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    handle = surgery.shrink(model, 0.1, calibration=torch.randn(2, 4))  # 10 % of 8 rounds down to 0
    assert handle.replaced == {} and "shrink: nothing removed: amount 0.1 rounds to zero channels" in caplog.text


@pytest.mark.slow
def test_the_trace_is_deterministic_where_many_temporaries_are_freed():
    """Tracked tensors are kept alive for the trace: a freed tensor's id, reused by another,
    once made maxvit_t's coupling (and so its plan) change from one shrink to the next."""
    model = torchvision.models.get_model("maxvit_t", weights=None, num_classes=10).eval()
    x = torch.randn(1, 3, 224, 224)
    first = surgery.shrink(model, 0.3, calibration=x)
    plan = first.structure()
    first.restore()
    second = surgery.shrink(model, 0.3, calibration=x)
    assert second.structure() == plan and len(plan) > 100
    assert sum("kept whole" in op for op in second.frozen_ops) == 4  # each stage's attention reads its input width
    second.restore()


def test_layer_norms_that_lose_channels_are_named_or_kept_with_renormalise_false(caplog):
    """A LayerNorm over fewer channels changes its statistics: said, and avoidable."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)).eval()
    original = copy.deepcopy(model)
    x = torch.randn(4, 8)
    handle = surgery.shrink(model, 0.5, calibration=x)
    assert handle.renormalised == ["1"] and "now normalise over fewer channels" in caplog.text
    handle.restore()
    kept = surgery.shrink(model, 0.5, calibration=x, renormalise=False)
    assert kept.replaced == {} and torch.equal(model(x), original(x))


@dataclasses.dataclass
class Features:
    features: torch.Tensor
    logits: torch.Tensor


class DataclassOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        features = torch.relu(self.a(x))
        return Features(features.to(torch.float64), self.b(features))  # a cast on the way out, too


def test_outputs_inside_dataclasses_and_casts_keep_their_shapes():
    model = DataclassOutput().eval()
    x = torch.randn(4, 8)
    handle = surgery.shrink(model, 0.5, calibration=x)
    assert model(x).features.shape == (4, 16) and handle.replaced == {}  # a's channels reach the output


def test_frozen_weights_dtype_hooks_and_parametrizations_survive():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).double().eval()
    model.layer1[0].conv1.weight.requires_grad_(False)
    seen = []
    model.layer2[0].conv1.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    handle = surgery.shrink(model, 0.5, calibration=x)
    assert model.layer1[0].conv1.out_channels == 32 and not model.layer1[0].conv1.weight.requires_grad
    assert model.layer1[0].bn1.running_mean.dtype == torch.float64 and model.fc.weight.requires_grad
    assert "layer2.0.conv1" not in handle.replaced  # a new layer would drop the user's hook
    seen.clear()
    model(x)
    assert len(seen) == 1
    handle.restore()
    linear = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    torch.nn.utils.parametrizations.weight_norm(linear[0])
    handle = surgery.shrink(linear, 0.5, calibration=torch.randn(2, 8))
    assert "0" not in handle.replaced and hasattr(linear[0], "parametrizations")


def test_round_to_keeps_multiples_and_global_scope_keeps_every_family():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 100), nn.ReLU(), nn.Linear(100, 3)).eval()
    surgery.shrink(model, 0.5, calibration=torch.randn(2, 8), round_to=8)
    assert model[0].out_features == 56  # 50 kept, rounded up to a multiple of 8
    branches = Branches().eval()
    with torch.no_grad():
        branches.small.weight.mul_(1e-3)
    surgery.shrink(branches, 0.5, calibration=torch.randn(2, 8), scope="global")
    assert branches.small.out_features >= 1 and branches.large.out_features >= 1
    assert branches.small.out_features + branches.large.out_features == 16


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small, self.large = nn.Linear(8, 16), nn.Linear(8, 16)
        self.head = nn.Linear(32, 2)

    def forward(self, x):
        return self.head(torch.cat([torch.relu(self.small(x)), torch.relu(self.large(x))], dim=1))


class Interrupting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.calls = nn.Linear(8, 16), nn.Linear(16, 3), 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:  # the check forward
            raise KeyboardInterrupt
        return self.b(torch.relu(self.a(x)))


def test_an_interrupt_and_a_later_surgery_never_leave_the_model_half_shrunk():
    model = Interrupting().eval()
    before = snapshot(model)
    with pytest.raises(KeyboardInterrupt):
        surgery.shrink(model, 0.5, calibration=torch.randn(2, 8))
    assert snapshot_differences(before, snapshot(model)) == []
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    handle = surgery.shrink(model, 0.5, calibration=torch.randn(1, 3, 32, 32))
    pruned = surgery.prune(model, 0.5, progress=False)
    with pytest.raises(surgery.AlreadyModifiedError, match="restore or bake that first"):
        handle.restore()
    pruned.restore()
    handle.restore()
    assert model.layer1[0].conv1.out_channels == 64


def test_selection_of_containers_and_hostile_arguments():
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)
    handle = surgery.shrink(model, 0.5, calibration=x, select="layer1")
    assert {name.split(".")[0] for name in handle.replaced} == {"layer1"}
    handle.restore()
    with pytest.raises(ConfigError, match="shrink.calibration"):
        surgery.shrink(model, 0.5, calibration=[])
    handle = surgery.shrink(model, 0.5, calibration=x, importance=lambda w: w.norm(dim=1).tolist())
    assert handle.replaced  # a list of scores is fine
    plan = handle.structure()
    handle.restore()
    text = json.dumps(plan)
    fresh = surgery.rebuild(lambda: torchvision.models.resnet18(weights=None, num_classes=10), text)
    assert fresh.layer1[0].conv1.out_channels == 32
    with pytest.raises(ConfigError, match="rebuild.factory"):
        surgery.rebuild(None, plan)
    broken = json.loads(text)
    broken["layer1.0.conv1"]["args"]["out_channels"] = "32"
    with pytest.raises(ConfigError, match=r"rebuild.plan='\$model': the layer entries were changed"):
        surgery.rebuild(lambda: torchvision.models.resnet18(weights=None, num_classes=10), broken)
    del broken["$model"]  # an unsealed plan (made by hand) is still checked as it is built
    with pytest.raises(ConfigError, match="rebuild.plan='Conv2d': cannot be built"):
        surgery.rebuild(lambda: torchvision.models.resnet18(weights=None, num_classes=10), broken)
    with pytest.raises(ConfigError, match="HeadLayout.projections"):
        surgery.HeadLayout("qkv", "head_dim")
    with pytest.raises(ConfigError, match="HeadLayout.heads"):
        surgery.HeadLayout(("q", "k", "v"), "head_dim", heads=["n_heads"])


@pytest.mark.parametrize("name", ["efficientnet_b0", "regnetx_002"])
def test_timm_norms_with_their_own_constructor_are_resized_in_place(name):
    """timm's BatchNormAct2d cannot be built from BatchNorm2d's arguments: it is resized in
    place (same object, sliced statistics), restored exactly and rebuilt from the plan."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    factory = lambda: timm.create_model(name, pretrained=False, num_classes=10)
    model = with_statistics(factory())
    original = copy.deepcopy(model)
    before = snapshot(model)
    x = torch.randn(2, 3, 64, 64)
    norm = model.get_submodule("bn1" if name == "efficientnet_b0" else "stem.bn")
    handle = surgery.shrink(model, 0.3, calibration=x)
    assert type(norm).__name__ == "BatchNormAct2d" and norm.num_features < 32
    assert model.get_submodule("bn1" if name == "efficientnet_b0" else "stem.bn") is norm
    assert 1 - handle.params()["after"] / handle.params()["before"] > 0.3
    with torch.no_grad():
        torch.testing.assert_close(model(x), masked_like(original, handle)(x), rtol=1e-4, atol=1e-5)
    plan = json.loads(json.dumps(handle.structure()))
    handle.restore()
    assert snapshot_differences(before, snapshot(model)) == [] and norm.num_features == 32
    baked = surgery.shrink(model, 0.3, calibration=x).bake()
    fresh = surgery.rebuild(factory, plan).eval()
    fresh.load_state_dict(baked.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(x), baked(x))


def test_plan_is_a_deprecated_alias_of_structure_that_warns_once(monkeypatch):
    from surgery.ops.shrink import replacing

    monkeypatch.setattr(replacing, "_WARNED", set())
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    handle = surgery.shrink(model, 0.5, calibration=torch.randn(2, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert handle.plan() == handle.structure()
        handle.plan()
    assert [type(w.message) for w in caught] == [DeprecationWarning]
