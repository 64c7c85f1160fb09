"""capture, keyword-input batches in compare/prune/capture, and user criteria and transforms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery.core.errors import ConfigError
from surgery.ops.sparsity.criteria import CRITERIA, compute_masks
from surgery.testing import module_hook_counts, snapshot, snapshot_differences


class KeywordModel(nn.Module):
    """Takes keyword inputs only, Hugging Face style."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        h = torch.relu(self.proj(self.embed(input_ids))) * attention_mask.unsqueeze(-1)
        return {"logits": self.head(h).mean(1)}


def keyword_batches(n: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {"input_ids": torch.randint(0, 20, (2, 5), generator=g), "attention_mask": torch.ones(2, 5)} for _ in range(n)
    ]


def test_dict_batches_work_in_prune_capture_and_compare():
    torch.manual_seed(0)
    model, batches = KeywordModel().eval(), keyword_batches()
    reference = KeywordModel().eval()
    reference.load_state_dict(model.state_dict())
    with surgery.prune(model, 0.5, select=["proj", "head"], calibration=batches) as handle:
        assert handle.sparsity() == pytest.approx(0.5)
        with surgery.capture(model, select="proj", what=("inputs", "outputs")) as seen:
            for batch in batches:
                model(**batch)
        assert [t.shape for t in seen.inputs["proj"]] == [(2, 5, 8)] * 3  # the keyword input reached proj
        drift = surgery.compare(reference, model, batches)
        assert not drift.identical and 0 < drift.cosine < 1
    assert surgery.compare(reference, model, batches).identical


def test_a_dict_batch_with_non_string_keys_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"compare.inputs='batch 0': has the key 0"):
        surgery.compare(nn.Linear(2, 2), nn.Linear(2, 2), [{0: torch.randn(1, 2)}])


def test_capture_reductions_match_the_tensors_they_summarise(mlp, mlp_input):
    with surgery.capture(mlp, select="0", reduce="keep") as kept:
        mlp(mlp_input)
        mlp(mlp_input * 2)
    first, second = kept.outputs["0"]
    for reduce, expected in [
        ("sum", first.double() + second.double()),
        ("minmax", (min(first.min(), second.min()).item(), max(first.max(), second.max()).item())),
    ]:
        with surgery.capture(mlp, select="0", reduce=reduce) as seen:
            mlp(mlp_input)
            mlp(mlp_input * 2)
        assert torch.equal(seen.outputs["0"], expected) if reduce == "sum" else seen.outputs["0"] == expected
    with surgery.capture(mlp, select="0", what="inputs", reduce="sq_norms") as seen:
        mlp(mlp_input)
    assert torch.allclose(seen.inputs["0"]["sq_norms"], (mlp_input.double() ** 2).sum(0))
    assert seen.inputs["0"]["rows"] == mlp_input.shape[0]


def test_capture_removes_its_hooks_also_when_the_block_raises(mlp, mlp_input):
    before = snapshot(mlp)
    with pytest.raises(RuntimeError, match="boom"), surgery.capture(mlp, what=("inputs", "outputs")):
        assert sum(module_hook_counts(mlp).values()) == 3 * 5  # 5 submodules: a pre hook (with its kwargs flag), a hook
        raise RuntimeError("boom")
    assert snapshot_differences(before, snapshot(mlp)) == []


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"what": "gradients"}, "capture.what"),
        ({"reduce": "median"}, "capture.reduce"),
        ({"select": "nope"}, "capture.select"),
    ],
)
def test_capture_bad_arguments_name_the_field(mlp, kwargs, field):
    with pytest.raises(ConfigError) as info:
        surgery.capture(mlp, **kwargs)
    assert info.value.field == field


def test_a_callable_criterion_reproduces_l1_unstructured_exactly(convnet_factory):
    built_in, custom = convnet_factory(), convnet_factory()
    for scope in ("layer", "global"):
        with (
            surgery.prune(built_in, 0.6, scope=scope) as a,
            surgery.prune(custom, 0.6, scope=scope, method=lambda w, stats: w.abs()) as b,
        ):
            assert a.masks().keys() == b.masks().keys()
            assert all(torch.equal(a.masks()[k], b.masks()[k]) for k in a.masks())


GOLDEN = {  # sha256 of the packed masks made by the criteria before they became registered functions
    ("l1_unstructured", "layer", 2.0, 0): "50e1d779e3cc4296",
    ("l1_unstructured", "global", 2.0, 0): "7c09bb4a695b7920",
    ("random_unstructured", "layer", 2.0, 0): "62604d7ece141abb",
    ("random_unstructured", "global", 2.0, 0): "ce54499456d5a88f",
    ("ln_structured", "layer", 1.0, 0): "a1b9d4be89c0190a",
    ("ln_structured", "layer", 2.0, 1): "122eda737b348f2b",
    ("ln_structured", "layer", float("inf"), 1): "a76fa8a5102c48fa",
    ("ln_structured", "global", 2.0, 0): "e0f1c748f005effb",
    ("ln_structured", "global", 1.0, 1): "2d4bbeb18422326a",
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=[f"{m}-{s}-{n}-{d}" for m, s, n, d in GOLDEN])
def test_built_in_criteria_give_the_same_masks_as_before(key):
    import hashlib

    from surgery.ops.sparsity.criteria import pack

    method, scope, n, dim = key
    g = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(16, 8, 3, 3, generator=g),
        torch.randn(32, 16, generator=g),
        torch.randn(10, 32, generator=g),
    ]
    masks = compute_masks(weights, 0.37, method=method, scope=scope, n=n, dim=dim, seed=5)
    digest = hashlib.sha256(b"".join(pack(m).numpy().tobytes() for m in masks)).hexdigest()[:16]
    assert digest == GOLDEN[key]


@pytest.mark.parametrize(
    "score,message",
    [
        (lambda w, s: w.abs().flatten(), "returned \\(128,\\)"),
        (lambda w, s: w * float("nan"), "NaN scores"),
        (lambda w, s: "high", "returned str"),
    ],
)
def test_a_bad_score_is_refused_and_the_model_is_unchanged(mlp, score, message):
    before = snapshot(mlp)
    with pytest.raises(ConfigError, match=message):
        surgery.prune(mlp, 0.5, method=score)
    assert snapshot_differences(before, snapshot(mlp)) == []


def test_criteria_that_need_calibration_say_so_and_registry_names_are_checked(mlp):
    surgery.register_criterion("needs_stats", lambda w, stats: w.abs() * stats.input_norms, needs_calibration=True)
    try:
        with pytest.raises(ConfigError, match="pass calibration batches"):
            surgery.prune(mlp, 0.5, method="needs_stats")
        with pytest.raises(ConfigError, match="already registered"):
            surgery.register_criterion("needs_stats", lambda w, stats: w)
        with pytest.raises(ConfigError, match="did you mean 'needs_stats'"):
            surgery.prune(mlp, 0.5, method="needs_stat")
    finally:
        CRITERIA.unregister("needs_stats")


def test_prune_spec_is_frozen_validated_and_accepted(mlp):
    with pytest.raises(ConfigError, match="prune.amount=2"):
        surgery.PruneSpec(2)
    spec = surgery.PruneSpec(0.25, method="ln_structured", n=1)
    with pytest.raises(AttributeError):
        spec.amount = 0.5
    with surgery.prune(mlp, spec) as handle:
        assert handle.spec is spec and handle.sparsity() == pytest.approx(0.25, abs=0.07)


def test_attach_transform_is_exact_stacks_with_prune_and_records_its_undo(mlp, mlp_input):
    before = snapshot(mlp)
    pruned = surgery.prune(mlp, 0.5)
    clamp = surgery.attach_transform(mlp, {"2.weight": lambda w: w.clamp(-0.05, 0.05)})
    assert mlp[2].weight.abs().max() <= 0.05 and (mlp[2].weight == 0).float().mean() == 0.5
    with torch.no_grad():
        mlp[2].weight.add_(1.0)  # an outside edit: both transforms are re-applied before the next forward
    mlp(mlp_input)
    assert mlp[2].weight.abs().max() <= 0.05
    assert [type(r).__name__ for r in clamp.records] == ["AttachedTransform"]
    with pytest.raises(surgery.AlreadyModifiedError):
        pruned.restore()  # undo in reverse order
    clamp.restore()
    pruned.restore()
    assert snapshot_differences(before, snapshot(mlp)) == []  # the exact originals, as before any surgery
    with pytest.raises(ConfigError, match="transforms='9.weight'"):
        surgery.attach_transform(mlp, {"9.weight": torch.abs})


# --- found by review: each was silently wrong or a raw exception --------------------------------------


def test_capture_on_a_compiled_model_records_its_layers(mlp, mlp_input):
    compiled = torch.compile(mlp, backend="eager")
    compiled(mlp_input)  # code compiled before the capture's hooks existed
    with surgery.capture(compiled, select=nn.Linear) as seen:
        compiled(mlp_input)
    assert sorted(seen.outputs) == ["0", "2", "4"]


def test_a_criterion_that_edits_its_weight_in_place_cannot_corrupt_the_model(mlp):
    before = snapshot(mlp)
    surgery.prune(mlp, 0.5, method=lambda w, stats: w.abs_()).restore()
    assert snapshot_differences(before, snapshot(mlp)) == []


def test_wanda_scores_align_with_the_input_axis_of_convolutions_and_conv1d():
    transformers = pytest.importorskip("transformers")
    conv1d = transformers.pytorch_utils.Conv1D(6, 6)  # weight (in, out) = (6, 6): a wrong axis would not fail
    stats = surgery.LayerStats("c", torch.arange(1.0, 7.0) ** 2, 4, weight_axis=0)
    assert torch.equal(stats.norms_like(conv1d.weight).flatten(), torch.arange(1.0, 7.0))
    assert stats.norms_like(conv1d.weight).shape == (6, 1)
    conv = nn.Conv2d(3, 5, 3)
    with surgery.capture(conv, select=lambda m, n: True, what="inputs", reduce="sq_norms") as seen:
        conv(torch.ones(2, 3, 4, 4))
    stats = surgery.LayerStats("", seen.inputs[""]["sq_norms"], seen.inputs[""]["rows"])
    assert stats.norms_like(conv.weight).shape == (1, 3, 1, 1)
    with pytest.raises(ConfigError, match="grouped convolution"):
        stats.norms_like(nn.Conv2d(3, 3, 3, groups=3).weight)


def test_unbatched_convolution_inputs_are_summarised_per_channel():
    conv = nn.Conv1d(2, 4, 3)
    with surgery.capture(conv, select=lambda m, n: True, what="inputs", reduce="sq_norms") as seen:
        conv(torch.ones(2, 10))  # (C, L): no batch dimension
    assert seen.inputs[""]["sq_norms"].tolist() == [10.0, 10.0]


def test_per_channel_activation_ranges_follow_the_feature_axis_of_every_batch():
    layer = nn.Sequential(nn.Linear(3, 3))
    batches = [torch.randn(5, 3), torch.randn(2, 3, 3) * 100]
    with surgery.quantize(
        layer, weights=None, activations=surgery.GridSpec(per_channel=True), calibration=batches, progress=False
    ) as handle:
        scale = handle.qparams()["0.scale"]
    with torch.no_grad():
        outs = [layer(b).reshape(-1, 3) for b in batches]
    expected = [
        (max(0.0, max(o[:, c].max().item() for o in outs)) - min(0.0, min(o[:, c].min().item() for o in outs))) / 255
        for c in range(3)
    ]
    assert scale.tolist() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "observe,message",
    [
        (lambda x, prev, spec: (x.amin(1) * float("nan"), x.amax(1)), "not finite"),
        (lambda x, prev, spec: (0.0, 1.0), "returned tuple"),
        (lambda x, prev, spec: (x.amin(), x.amax()), "one per row"),
    ],
)
def test_a_bad_observer_result_is_refused(mlp, mlp_input, observe, message):
    before = snapshot(mlp)
    with pytest.raises(ConfigError, match=message):
        surgery.quantize(mlp, weights=surgery.GridSpec(per_channel=True, symmetric=True, observer=observe))
    assert snapshot_differences(before, snapshot(mlp)) == []


@pytest.mark.parametrize(
    "call,field",
    [
        (lambda m: surgery.prune(m, 0.5, method=["l1"]), "prune.method"),
        (lambda m: surgery.GridSpec(observer=["minmax"]), "GridSpec.observer"),
        (lambda m: surgery.prune(m, 0.5, calibration="abc"), "prune.calibration"),
        (lambda m: surgery.prune(m, 0.5, calibration=5), "prune.calibration"),
        (lambda m: surgery.prune(m, 0.5, calibration=[], progress=False), "prune.calibration"),
        (lambda m: surgery.prune(m, 0.5, method=lambda w: w), "prune.method"),
        (lambda m: surgery.prune(m, 0.5, method="random_unstructured", seed=2**80), "prune.seed"),
        (
            lambda m: surgery.register_criterion("flagged", lambda w, s: w, structured="no"),
            "register_criterion.structured",
        ),
        (lambda m: surgery.GridSpec(averaging=True), "GridSpec.averaging"),
        (lambda m: surgery.attach_transform(m, {"0.weight": torch.abs}, kind=3), "kind"),
        (lambda m: surgery.attach_transform(m, {"0.weight": lambda w: w[0].clone()}), "transforms"),
        (lambda m: surgery.attach_transform(m, {"0.weight": lambda w: w * 2}), "transforms['0.weight']"),
    ],
)
def test_hostile_arguments_get_one_line_errors_and_change_nothing(mlp, call, field):
    before = snapshot(mlp)
    with pytest.raises(ConfigError) as info:
        call(mlp)
    assert info.value.field == field and "\n" not in str(info.value)
    assert snapshot_differences(before, snapshot(mlp)) == []


def test_a_transform_object_must_edit_in_place(mlp):
    class Clamp:
        kind = "clamp"

        def apply(self, param):
            return param.clamp(-0.01, 0.01)  # a new tensor: the weight would be left as it was

    with pytest.raises(ConfigError, match="must edit param in place"):
        surgery.attach_transform(mlp, {"0.weight": Clamp()})


def test_a_capture_is_a_context_manager_entered_once(mlp, mlp_input):
    seen = surgery.capture(mlp)
    with pytest.raises(RuntimeError, match="with surgery.capture"):
        _ = seen.outputs
    with seen, pytest.raises(RuntimeError, match="already active"), seen:
        pass


def test_a_block_s_inputs_are_caught_before_its_own_pre_hooks_which_run_once_when_it_runs_again():
    """A pre-hook on the block that rewrites its input (online rotation, input rewriting) ran
    on the caught inputs and again when the block ran on them: they are caught before it."""
    from surgery.core.block_inputs import catch_inputs
    from surgery.core.inputs import Call

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    doubles = model[1].register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    x = torch.randn(3, 4)
    with torch.no_grad():
        caught = catch_inputs(model, model[1], [Call((x,))])
        ((args, _),) = list(caught)
        assert torch.equal(args[0], model[0](x))  # not doubled
        assert torch.equal(model[1](*args), model[1].forward(model[0](x) * 2))  # doubled once, by the block
    doubles.remove()


def test_a_call_moves_its_tensors_only_to_a_module_on_one_device_from_one_other_device():
    from surgery.core.inputs import Call

    x, lengths = torch.randn(2, 4), torch.tensor([2, 1])
    call = Call((x,), {"lengths": lengths})
    assert call.for_model(nn.Linear(4, 4)) is call  # already there: the same objects
    split = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))  # a block onloaded elsewhere
    assert call.for_model(split) is call and call.for_model(lambda x: x) is call
    mixed = Call((x.to("meta"),), {"lengths": lengths})  # activations elsewhere, lengths on the CPU
    assert mixed.for_model(nn.Linear(4, 4)) is mixed  # (one other device: tests/test_devices.py, on a GPU)
