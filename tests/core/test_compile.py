"""torch.compile: one graph with surgery attached, eager-equal outputs, guards kept while training,
restore after compile, and surgery attached to an already compiled model."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from unittest import mock

import pytest
import torch
from support import edit_in_place, tiny_llama  # tests/support.py
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import surgery
from surgery import GridSpec
from surgery.core import compiled
from surgery.ops.numerics.fake_quant import fake_quantize
from surgery.ops.rewrite import rewriting as rw
from surgery.testing import module_hook_counts, snapshot, snapshot_differences

Attach = Callable[[nn.Module, torch.Tensor], list]


pytestmark = pytest.mark.compile  # torch.compile: seconds per test


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Every test starts and ends with empty dynamo caches (compiled code holds model references)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _calibrated(spec: GridSpec, where: str = "output", weights: GridSpec | None = None) -> Attach:
    return lambda m, x: [
        surgery.quantize(m, weights=weights, activations=spec, where=where, calibration=[x, 0.5 * x], progress=False)
    ]


# Each case attaches surgery to a model and returns its handles (restored last-in-first-out).
CASES: dict[str, Attach] = {
    "prune-l1": lambda m, x: [surgery.prune(m, 0.5)],
    "prune-random-global": lambda m, x: [surgery.prune(m, 0.4, method="random_unstructured", scope="global")],
    "prune-ln-structured": lambda m, x: [surgery.prune(m, 0.5, method="ln_structured")],
    "quantize-weights-per-channel": lambda m, x: [surgery.quantize(m)],
    "quantize-weights-per-tensor-4bit": lambda m, x: [surgery.quantize(m, weights=GridSpec(bits=4))],
    "activations-output-per-tensor": _calibrated(GridSpec()),
    "activations-output-per-channel": _calibrated(GridSpec(per_channel=True, symmetric=True)),
    "activations-input-per-tensor": _calibrated(GridSpec(), where="input"),
    "activations-input-per-channel": _calibrated(GridSpec(per_channel=True), where="input"),
    "weights-and-activations": _calibrated(GridSpec(), weights=GridSpec(per_channel=True, symmetric=True)),
    "prune-then-quantize": lambda m, x: [surgery.prune(m, 0.5), *_calibrated(GridSpec(), weights=GridSpec())(m, x)],
}
REWRITES = {
    "normalize": rw.Normalize(0.5, 0.25),
    "cast": rw.Cast(torch.float32),
    "clamp": rw.Clamp(min=-1.0, max=1.0),
    "resize": rw.Resize(10),
    "channels-last": rw.ChannelsLast(),
    "identity": rw.Identity(),
}


def _rewrite(fn: Callable, select: object = None) -> Attach:
    return lambda m, x: [surgery.rewrite_inputs(m, fn, select=select)]


CASES |= {f"rewrite-{name}-root": _rewrite(fn) for name, fn in REWRITES.items() if name != "resize"}
CASES |= {
    f"rewrite-{name}-layers": _rewrite(fn, nn.Conv2d if name == "resize" else (nn.Conv2d, nn.Linear))
    for name, fn in REWRITES.items()
}
CASES["prune-quantize-rewrite"] = lambda m, x: [
    *CASES["prune-then-quantize"](m, x),
    surgery.rewrite_inputs(m, rw.Clamp(min=-2.0)),
]
INPUT_SHAPES = {"convnet": (2, 3, 12, 12), "mlp": (6, 8)}


def hook_count(model: nn.Module) -> int:
    return sum(module_hook_counts(model).values())


def restore(handles: list) -> None:
    for handle in reversed(handles):
        handle.restore()


def matrix() -> list:
    params = []
    for case in CASES:
        for model in INPUT_SHAPES:
            if model == "mlp" and ("resize" in case or "channels-last" in case):
                continue  # 2-d inputs: Resize has no spatial dims, ChannelsLast passes them through
            params.append(pytest.param(case, model, id=f"{case}-{model}"))
    return params


# --- one graph, equal to eager --------------------------------------------------------------


@pytest.mark.parametrize(("case", "model_name"), matrix())
def test_attached_before_compile_gives_one_graph_equal_to_eager(case, model_name, mlp_factory, convnet_factory):
    model = {"convnet": convnet_factory, "mlp": mlp_factory}[model_name]()
    x = torch.randn(INPUT_SHAPES[model_name], generator=torch.Generator().manual_seed(3))
    handles = CASES[case](model, x)
    with torch.no_grad():
        expected = model(x)
        counter = CompileCounterWithBackend("aot_eager")
        got = torch.compile(model, backend=counter, fullgraph=True)(x)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs"
    if case == "rewrite-resize-layers":  # aot_eager decomposes upsample_bilinear2d: 1e-7 apart, surgery or not
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(got, expected)
    restore(handles)
    assert hook_count(model) == 0


def test_explain_reports_no_graph_break_for_a_custom_root_with_every_verb(convnet_factory):
    """``explain`` counts graphs - 1: the root module's own hooks (which ``torch.compile`` calls
    outside the graph of ``forward``) must not become graphs of their own."""
    model, x = convnet_factory(), torch.randn(2, 3, 12, 12)
    handles = CASES["prune-quantize-rewrite"](model, x)
    explanation = torch._dynamo.explain(model)(x)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    restore(handles)


def test_plain_prune_no_longer_breaks_on_the_data_pointer_check():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    with surgery.prune(model, amount=0.5):
        assert torch._dynamo.explain(model)(torch.randn(2, 8)).graph_break_count == 0


def test_add_noise_breaks_the_graph_on_a_submodule_but_draws_the_same_noise_as_eager(convnet, image_input):
    """Documented limitation: AddNoise draws from its own CPU torch.Generator, which dynamo
    cannot put in a graph; the values still follow the eager sequence call after call."""
    twin = copy.deepcopy(convnet)
    with (
        surgery.rewrite_inputs(convnet, rw.AddNoise(0.1, seed=4), select="conv2"),
        surgery.rewrite_inputs(twin, rw.AddNoise(0.1, seed=4), select="conv2"),
        torch.no_grad(),
    ):
        compiled_model = torch.compile(convnet, backend="aot_eager")
        for _ in range(3):
            assert torch.equal(compiled_model(image_input), twin(image_input))


# --- guards at run time ---------------------------------------------------------------------


def pruned_entries(model: nn.Module, masks: dict[str, torch.Tensor]) -> torch.Tensor:
    params = dict(model.named_parameters())
    return torch.cat([params[name].detach()[~mask] for name, mask in masks.items()])


def on_grid(param: torch.Tensor, quantizer) -> bool:
    value = param.detach()
    return torch.equal(
        fake_quantize(value, quantizer.scale, quantizer.zero_point, quantizer.axis, quantizer.spec), value
    )


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_training_the_compiled_model_keeps_masks_and_the_grid(backend, mlp_factory, mlp_input):
    model = mlp_factory().train()
    pruning = surgery.prune(model, 0.5)
    quantizing = surgery.quantize(model, weights=GridSpec(bits=4, symmetric=True, per_channel=True), select=["0", "2"])
    masks = pruning.masks()
    reference = mlp_factory().train()  # a plain eager twin: masks and grid applied by hand
    compiled_model = torch.compile(model, backend=backend, fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    for step in range(4):
        if step:  # right after the step, before any forward: the step post-hook re-applied both
            assert pruned_entries(model, masks).abs().sum() == 0
            assert all(on_grid(dict(model.named_parameters())[n], q) for n, q in quantizing.weights.items())
        reference.load_state_dict(model.state_dict())
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if name in masks:
                    param.masked_fill_(~masks[name], 0)
                if name in quantizing.weights:
                    q = quantizing.weights[name]
                    param.copy_(fake_quantize(param, q.scale, q.zero_point, q.axis, q.spec))
        loss = compiled_model(mlp_input).square().mean()
        assert torch.equal(loss, reference(mlp_input).square().mean())
        assert pruned_entries(model, masks).abs().sum() == 0
        params = dict(model.named_parameters())
        assert all(on_grid(params[name], q) for name, q in quantizing.weights.items())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():  # evaluating after the last step: a different (no-grad) graph, same guarantee
        compiled_model.eval()(mlp_input)
    assert pruned_entries(model, masks).abs().sum() == 0
    surgery.compose(pruning, quantizing).restore()
    assert hook_count(model) == 0


def test_compiled_inference_leaves_unchanged_weights_alone(mlp, mlp_input):
    """The check costs a comparison: an unchanged weight is not rewritten (its version stays)."""
    with surgery.prune(mlp, 0.5), torch.no_grad():
        compiled_model = torch.compile(mlp, backend="eager", fullgraph=True)
        compiled_model(mlp_input)
        versions = [p._version for p in mlp.parameters()]
        for _ in range(3):
            compiled_model(mlp_input)
        assert [p._version for p in mlp.parameters()] == versions


def test_load_state_dict_and_in_place_edits_are_masked_again_in_the_compiled_forward(mlp, mlp_input):
    unpruned = copy.deepcopy(mlp.state_dict())
    with surgery.prune(mlp, 0.5) as handle, torch.no_grad():
        compiled_model = torch.compile(mlp, backend="aot_eager", fullgraph=True)
        expected = compiled_model(mlp_input)
        mlp.load_state_dict(unpruned)
        assert pruned_entries(mlp, handle.masks()).abs().sum() > 0
        assert torch.equal(compiled_model(mlp_input), expected)
        mlp[2].weight.add_(1.0)
        compiled_model(mlp_input)
        assert pruned_entries(mlp, handle.masks()).abs().sum() == 0


def test_copies_of_a_model_under_surgery_compile_with_their_own_guards(mlp, mlp_input, duplicate):
    with surgery.prune(mlp, 0.5) as handle:
        masks, original = handle.masks(), copy.deepcopy(mlp.state_dict())
        twin = duplicate(mlp)
        with torch.no_grad():
            for param in twin.parameters():
                param.add_(1.0)  # nonzero pruned entries, in the copy only
            torch.compile(twin, backend="aot_eager", fullgraph=True)(mlp_input)
        assert pruned_entries(twin, masks).abs().sum() == 0
        params = dict(twin.named_parameters())
        assert all(torch.equal(params[n][m], original[n][m] + 1) for n, m in masks.items())
        assert all(torch.equal(v, original[k]) for k, v in mlp.state_dict().items())


def test_copies_under_the_same_pruning_share_their_compiled_code(mlp_factory, mlp_input):
    """Guard tokens are graph inputs, not constants: no recompile per copy (dynamo allows 8)."""
    counter = CompileCounterWithBackend("eager")
    models = [mlp_factory() for _ in range(3)]
    handles = [surgery.prune(model, 0.5) for model in models]
    with torch.no_grad():
        for model in models:
            for param in model.parameters():
                param.add_(1.0)
            torch.compile(model, backend=counter, fullgraph=True)(mlp_input)
    assert counter.frame_count == 1
    for model, handle in zip(models, handles):
        assert pruned_entries(model, handle.masks()).abs().sum() == 0
        handle.restore()


def test_eager_forward_never_reaches_the_graph_operator(mlp, mlp_input):
    with surgery.prune(mlp, 0.5), mock.patch.object(compiled, "enforce", side_effect=AssertionError("compiled path")):
        mlp(mlp_input)


def test_restore_after_compile_gives_back_the_exact_model(convnet, image_input):
    before = snapshot(convnet)
    with torch.no_grad():
        expected = convnet(image_input)
        counter = CompileCounterWithBackend("aot_eager")
        compiled_model = torch.compile(convnet, backend=counter, fullgraph=True)
        handles = CASES["prune-quantize-rewrite"](convnet, image_input)
        changed = compiled_model(image_input)
        restore(handles)
        assert torch.equal(compiled_model(image_input), expected)  # dynamo re-guards on the hooks
    assert not torch.equal(changed, expected)
    assert counter.frame_count == 2
    assert snapshot_differences(before, snapshot(convnet)) == []


# --- surgery on an already compiled model, and dynamo's code cache --------------------------


def test_surgery_on_a_compiled_wrapper_applies_to_the_model_it_compiles(convnet, image_input):
    before = snapshot(convnet)
    compiled_model = torch.compile(convnet, backend="aot_eager")
    with torch.no_grad():
        plain = compiled_model(image_input)
        pruning = surgery.prune(compiled_model, 0.5, select=["conv2", "fc"])  # the model's own names
        quantizing = surgery.quantize(
            compiled_model,
            weights=None,
            activations=GridSpec(),
            select="conv1",
            calibration=[image_input],
            progress=False,
        )
        rewriting = surgery.rewrite_inputs(compiled_model, rw.Clamp(min=-1.0, max=1.0), select="conv2")
        assert list(pruning.masks()) == ["conv2.weight", "fc.weight"]
        assert list(quantizing.qparams()) == ["conv1.scale", "conv1.zero_point"]
        assert pruning.model is convnet
        assert torch.equal(compiled_model(image_input), convnet(image_input))  # the next call sees it all
        assert not torch.equal(compiled_model(image_input), plain)
        surgery.compose(pruning, quantizing, rewriting).restore()
        assert torch.equal(compiled_model(image_input), plain)
        again = surgery.rewrite_inputs(compiled_model, rw.Clamp(min=0.0, max=0.0), select="conv2")
        assert torch.equal(compiled_model(image_input), convnet(image_input))  # attached again: seen again
        again.restore()
    assert snapshot_differences(before, snapshot(convnet)) == []


def test_code_compiled_for_a_plain_instance_is_not_reused_for_one_under_surgery(convnet_factory, image_input):
    """Dynamo caches code per function; under its default it does not guard hook dicts that
    were empty when it traced, so a plain ConvNet's code would run the hooked one without hooks."""
    plain, hooked = convnet_factory(), convnet_factory()
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True), torch.no_grad():
        torch.compile(plain, backend="aot_eager")(image_input)  # compiled without hook guards
        handles = [
            surgery.rewrite_inputs(hooked, rw.Clamp(min=0.0, max=0.1), select="conv2"),
            surgery.quantize(
                hooked,
                weights=None,
                activations=GridSpec(bits=3),
                select="conv1",
                calibration=[image_input],
                progress=False,
            ),
        ]
        assert torch._dynamo.config.skip_nnmodule_hook_guards is False
        assert torch.equal(torch.compile(hooked, backend="aot_eager")(image_input), hooked(image_input))
        assert torch.equal(torch.compile(plain, backend="aot_eager")(image_input), plain(image_input))
        restore(handles)


def test_surgery_after_module_compile_in_place(mlp, mlp_input):
    mlp.compile(backend="aot_eager")
    with torch.no_grad():
        plain = mlp(mlp_input)
        with (
            surgery.prune(mlp, 0.5, select="2") as handle,
            surgery.rewrite_inputs(mlp, rw.Clamp(min=-0.5, max=0.5), select="4"),
        ):
            assert torch.equal(mlp(mlp_input), mlp._call_impl(mlp_input))  # compiled call == eager call
            assert (mlp[2].weight[~handle.masks()["2.weight"]] == 0).all()
            assert not torch.equal(mlp(mlp_input), plain)
        assert torch.equal(mlp(mlp_input), plain)


def test_prepare_unwraps_compiled_wrappers_only(mlp):
    wrapper = torch.compile(mlp, backend="eager")
    assert compiled.prepare(mlp) is mlp and compiled.prepare(wrapper) is mlp
    outer = nn.Sequential(wrapper)
    assert compiled.prepare(outer) is outer


# --- inductor, once, on a tiny model --------------------------------------------------------


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_inductor_matches_eager_and_keeps_masks_while_training(mlp_factory, mlp_input):
    """Tolerance: the float path may differ by reassociation in fused kernels (rtol 1e-5,
    atol 1e-6 on values of order 1); the fake-quant arithmetic itself has no sums to reorder
    and inductor calls the same GEMM as eager, so a flipped grid step would fail the test.
    Inductor's on-disk caches are bypassed so that this code, not a cached graph, is tested."""
    from torch._inductor import config as inductor_config

    model = mlp_factory()
    pruning = surgery.prune(model, 0.5)
    quantizing = surgery.quantize(model, activations=GridSpec(), calibration=[mlp_input], progress=False)
    with inductor_config.patch(force_disable_caches=True):
        compiled_model = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled_model(mlp_input), model(mlp_input), rtol=1e-5, atol=1e-6)
            versions = [p._version for p in model.parameters()]
            compiled_model(mlp_input)
            assert [p._version for p in model.parameters()] == versions  # unchanged weights: no rewrite
        edit_in_place(model)  # a hand-written update: only the compiled forward's check can see it
        masks = pruning.masks()
        assert pruned_entries(model, masks).abs().sum() > 0
        with torch.no_grad():
            compiled_model(mlp_input)
    assert pruned_entries(model, masks).abs().sum() == 0
    surgery.compose(pruning, quantizing).restore()


def test_dynamo_loaded_but_nothing_compiled_says_nothing(mlp, caplog, convnet_factory, image_input):
    """Building a torchvision model loads dynamo: a run with nothing compiled says nothing about
    hook guards; INFO once code was compiled, a WARNING when code compiled for the model is dropped."""
    import logging

    from torch._dynamo import convert_frame

    seen = convert_frame.input_codes.seen + convert_frame.output_codes.seen
    earlier = any(ref() is not None for ref in seen)  # code another test compiled in this process
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True), caplog.at_level(logging.INFO, logger="surgery"):
        surgery.prune(mlp, 0.5).restore()
        plain = convnet_factory()
        with torch.no_grad():
            torch.compile(plain, backend="aot_eager")(image_input)
        torch._dynamo.config.skip_nnmodule_hook_guards = True
        surgery.prune(plain, 0.5).restore()
    records = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("surgery")]
    expected = ["INFO", "INFO"] if earlier else ["INFO"]  # nothing compiled before the first: it said nothing
    assert [level for level, text in records if "skip_nnmodule_hook_guards" in text] == expected
    assert [level for level, text in records if "recompile on the next call" in text] == ["WARNING"]


LLAMA_VERBS = {
    "smooth": lambda m, ids: surgery.smooth(m, 0.5, calibration=[ids], progress=False),
    "awq": lambda m, ids: surgery.awq(m, weights=GridSpec(bits=4, group_size=32), calibration=[ids], progress=False),
    "rotate": lambda m, ids: surgery.rotate(m, calibration=[ids], progress=False),
}


@pytest.mark.parametrize("verb", list(LLAMA_VERBS))
def test_every_verb_applies_to_the_model_a_compiled_wrapper_compiles_and_refuses_work(verb):
    model, ids = tiny_llama(layers=2), torch.randint(0, 128, (2, 8))
    wrapper = torch.compile(model, backend="eager")
    with torch.no_grad():
        handle = LLAMA_VERBS[verb](wrapper, ids)
        assert handle.model is model
        assert torch.equal(wrapper(ids).logits, model(ids).logits)
    handle.restore()
    with pytest.raises(surgery.ConfigError, match=rf"^{verb}.work='w': is for an offloaded model"):
        if verb == "awq":
            surgery.awq(model, weights=GridSpec(bits=4, group_size=32), calibration=[ids], work="w", progress=False)
        elif verb == "smooth":
            surgery.smooth(model, 0.5, calibration=[ids], work="w", progress=False)
        else:
            surgery.rotate(model, calibration=[ids], work="w", progress=False)


def test_shrink_applies_to_the_model_a_compiled_wrapper_compiles(convnet, image_input):
    wrapper = torch.compile(convnet, backend="eager")
    with torch.no_grad():
        handle = surgery.shrink(wrapper, 0.5, calibration=image_input)
        assert handle.model is convnet
        assert torch.equal(wrapper(image_input), convnet(image_input))
    handle.restore()
