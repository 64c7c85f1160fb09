"""Learned rotations (SpinQuant's R1): Cayley SGD as SpinQuant steps it, orthogonal throughout,
fused to the same function and restorable, lower quantized error than the Hadamard it starts
from, and bad settings refused in one line with the model untouched."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from support import tiny_llama, tiny_moe  # tests/support.py

import surgery
from surgery.core import guards
from surgery.core.errors import ConfigError
from surgery.ops.equivalence import learned_rotation
from surgery.ops.equivalence.learned_rotation import LearnSpec, cayley_step
from surgery.ops.equivalence.rotation import hadamard
from surgery.tasks.tinyllama import load_llama
from surgery.tasks.tinylm import token_batches
from surgery.testing import assert_no_hooks

pytest.importorskip("transformers")


def batches(first: int = 0, count: int = 2) -> list[torch.Tensor]:
    return [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(first + i)) for i in range(count)]


def logits(model, batch=None) -> torch.Tensor:
    with torch.no_grad():
        return model(batches(7, 1)[0] if batch is None else batch).logits


def sgdg_step(p: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """SpinQuant's SGDG step (train_utils/optimizer.py, stiefel=True, momentum 0), transcribed
    as a reference; its random QR retraction (one step in 101) left out."""
    unity = p / (p.norm(p=2, dim=1, keepdim=True) + 1e-8)
    V = 0 * torch.zeros_like(grad.t()) - grad.t()  # noqa: N806 - its names
    MX = V @ unity  # noqa: N806
    XMX = unity @ MX  # noqa: N806
    XXMX = unity.t() @ XMX  # noqa: N806
    W_hat = MX - 0.5 * XXMX  # noqa: N806
    W = W_hat - W_hat.t()  # noqa: N806
    t = 0.5 * 2 / (torch.max(torch.sum(torch.abs(W), dim=0)) + 1e-8)
    alpha = min(t, lr)
    X = unity.t()  # noqa: N806
    Y = X + alpha * V  # noqa: N806
    for _ in range(5):
        Y = X + alpha * (W @ (0.5 * (X + Y)))  # noqa: N806
    return Y.t()


@pytest.mark.parametrize("lr", [1.5, 1e-3])
def test_the_cayley_step_is_spinquants_sgdg_step(lr):
    r = hadamard(64, seed=1).double()
    grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.testing.assert_close(cayley_step(r, grad, lr), sgdg_step(r, grad, lr), rtol=0, atol=1e-12)


def test_a_hundred_cayley_steps_keep_the_rotation_orthogonal():
    r = hadamard(64, seed=1).double()
    generator = torch.Generator().manual_seed(3)
    for step in range(100):
        r = cayley_step(r, torch.randn(64, 64, generator=generator, dtype=torch.float64), 1.5 * (1 + math.cos(step)))
    assert (r.t() @ r - torch.eye(64, dtype=torch.float64)).abs().max() < 1e-5
    assert not torch.allclose(r, hadamard(64, seed=1).double(), atol=0.1)  # it moved


def test_a_learned_rotation_computes_the_same_function_and_restores_bit_for_bit():
    model = tiny_llama(layers=2)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    before = logits(model)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    handle = surgery.rotate(model, calibration=batches(), learn={"steps": 4}, online=True, progress=False)
    learned = handle.rotation.double()
    assert (learned.t() @ learned - torch.eye(64, dtype=torch.float64)).abs().max() < 1e-5
    assert (learned - hadamard(64, 0).double()).abs().max() > 1e-5  # learning moved it
    assert list(handle.head_rotations) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]  # R2
    for head in handle.head_rotations.values():  # head_dim 16
        assert (head.double().t() @ head.double() - torch.eye(16, dtype=torch.float64)).abs().max() < 1e-5
    assert ((logits(model) - before).abs().max() / before.abs().max()) < 1e-5  # as the Hadamard test
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())
    hooks = [hook for m in model.modules() for hook in m._forward_pre_hooks.values()]
    assert not [hook for hook in hooks if "_quantized_inputs" in getattr(hook, "__qualname__", "")]
    handle.restore()
    assert_no_hooks(model)
    assert all(torch.equal(model.state_dict()[n], v) for n, v in state.items())
    assert torch.equal(logits(model), before)


def test_a_failing_step_leaves_the_model_as_it_was():
    model = tiny_llama(layers=2)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    state = {name: value.clone() for name, value in model.state_dict().items()}
    with mock.patch.object(learned_rotation, "cayley_step", side_effect=RuntimeError("boom")):
        with pytest.raises(RuntimeError, match="boom"):
            surgery.rotate(model, calibration=batches(), learn={"steps": 2}, progress=False)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert all(torch.equal(model.state_dict()[n], v) for n, v in state.items())
    assert_no_hooks(model)


def test_without_heads_only_the_stream_rotation_is_learned():
    model = tiny_llama(layers=2)
    handle = surgery.rotate(model, calibration=batches(), learn={"steps": 1, "heads": False}, progress=False)
    assert handle.head_rotations == {} and handle.rotation is not None
    handle.restore()


def test_a_learned_rotation_loses_less_than_the_hadamard_it_starts_from_on_held_out_text():
    model = load_llama()
    calibration = [x for x, _ in token_batches("train", 4, limit_batches=8)]
    held_out = [x for x, _ in token_batches("test", 16, limit_batches=2)]
    with torch.no_grad():
        references = [torch.log_softmax(model(x).logits, -1).flatten(0, -2) for x in held_out]
    inputs = surgery.GridSpec(bits=4, dynamic="token")  # W4A4, as learned (the default)
    found = []
    for learn in (None, {"steps": 50}):  # R1 and R2, about 3.5 s of learning on two cores
        handle = surgery.rotate(model, calibration=calibration, learn=learn, progress=False)
        found.append(quantized_kl(model, held_out, references, inputs))
        handle.restore()
    hadamard_kl, learned_kl = found
    # measured: 0.0775 -> 0.0728 (this seed, 0); seeds 1 and 2: 0.0764 -> 0.0713, 0.0792 -> 0.0766;
    # on an AMD EPYC without AVX-512 (other float kernels, another path from the same start)
    # 0.0757 -> 0.0750: the learning must lower the loss on held-out text, by how much varies
    assert learned_kl < hadamard_kl, (hadamard_kl, learned_kl)


def quantized_kl(model, held_out, references, activations) -> float:
    weights = surgery.GridSpec(bits=4, symmetric=True, per_channel=True)
    handle = surgery.quantize(
        model, weights=weights, activations=activations, where="input", exclude="lm_head", progress=False
    )
    found = []
    with torch.no_grad():
        for batch, reference in zip(held_out, references, strict=True):
            student = torch.log_softmax(model(batch).logits, -1).flatten(0, -2)
            found.append(torch.nn.functional.kl_div(student, reference, log_target=True, reduction="batchmean"))
    handle.restore()
    return torch.stack(found).mean().item()


@pytest.mark.parametrize(
    ("learn", "message"),
    [
        ({"steps": 0}, "rotate.learn.steps=0: must be a whole number of steps from 1 to 10,000"),
        ({"steps": -3}, "rotate.learn.steps=-3: must be a whole number of steps from 1 to 10,000"),
        ({"steps": 10**9}, "rotate.learn.steps=1000000000: must be a whole number of steps from 1 to 10,000"),
        ({"steps": True}, "rotate.learn.steps=True: must be a whole number"),
        ({"lr": 0}, "rotate.learn.lr=0: must be a finite number > 0"),
        ({"lr": float("nan")}, "rotate.learn.lr=nan: must be a finite number > 0"),
        ({"stepz": 5}, "rotate.learn.stepz=5: unknown setting; allowed: steps, lr, weights, activations, loss"),
        ({"loss": "mse"}, "rotate.learn.loss='mse': must be one of kl, task"),
        ({"weights": {"bits": 9}}, "rotate.learn.weights.bits=9: must be an integer in [2, 8]"),
        ({"activations": {"bits": 4}}, "rotate.learn.activations.dynamic: must be 'token' or 'tensor'"),
        ({"weights": None, "activations": None}, "rotate.learn='weights=None, activations=None': learns through"),
        ("yes", "rotate.learn='yes': must be null, true or false, a dict of settings, or a LearnSpec"),
    ],
)
def test_bad_learning_settings_are_refused_in_one_line_before_anything_changes(learn, message):
    model = tiny_llama(layers=2)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(ConfigError) as caught:
        surgery.rotate(model, calibration=batches(), learn=learn, progress=False)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
    assert all(torch.equal(model.state_dict()[n], v) for n, v in state.items())


def test_the_task_loss_needs_a_model_that_returns_one():
    model = tiny_llama(layers=2)
    with pytest.raises(ConfigError, match=r"^rotate.learn.loss='task': the model returned no loss on batch 0"):
        surgery.rotate(model, calibration=batches(), learn={"loss": "task", "steps": 1}, progress=False)
    with_labels = [{"input_ids": b, "labels": b} for b in batches()]
    handle = surgery.rotate(model, calibration=with_labels, learn={"loss": "task", "steps": 2}, progress=False)
    assert (handle.rotation - hadamard(64, 0)).abs().max() > 0
    handle.restore()


def test_an_offloaded_model_refuses_to_learn(tmp_path):
    tiny_llama(layers=2).save_pretrained(tmp_path / "model")
    source = surgery.offloaded(tmp_path / "model")
    with pytest.raises(ConfigError, match=r"^rotate.learn=.*: trains through the whole model's forward"):
        surgery.rotate(source, calibration=batches()[:1], online=False, learn=True, progress=False)


def test_learning_spec_defaults_are_spinquants_w4a4():
    spec = LearnSpec()
    assert (spec.steps, spec.lr, spec.loss) == (100, 1.5, "kl")
    assert (spec.weights.bits, spec.weights.symmetric, spec.weights.per_channel) == (4, True, True)
    assert (spec.activations.bits, spec.activations.symmetric, spec.activations.dynamic) == (4, False, "token")
    assert LearnSpec.of(False) is None and LearnSpec.of(None) is None and LearnSpec.of(True) == spec


def test_a_model_the_rotation_cannot_cover_is_refused_before_any_learning():
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128))
    state = {name: value.clone() for name, value in model.state_dict().items()}
    with mock.patch.object(learned_rotation, "cayley_step", side_effect=AssertionError("learning ran")):
        with pytest.raises(ConfigError, match=r"^rotate='transformer.h.0.ln_1': is a LayerNorm"):
            surgery.rotate(model.eval(), calibration=batches(), learn=True, progress=False)
    assert all(torch.equal(model.state_dict()[n], v) for n, v in state.items())


def test_an_iterator_of_batches_learns_from_every_batch():
    model = tiny_llama(layers=2)
    seen = []
    original = learned_rotation._Objective.__call__

    def spy(self, values, index, call):
        seen.append(index)
        return original(self, values, index, call)

    with mock.patch.object(learned_rotation._Objective, "__call__", spy):
        handle = surgery.rotate(model, calibration=iter(batches(0, 3)), learn={"steps": 4}, progress=False)
    assert seen == [0, 1, 2, 0]  # the first batch, drawn to trace the stream, is learned from too
    handle.restore()


@pytest.mark.parametrize(("family", "heads"), [("qwen3_moe", 2), ("deepseek_v3", 0)])  # MLA: no v_proj, no R2
def test_a_mixture_of_experts_learns_its_rotation_and_restores(family, heads):
    model = tiny_moe(family, layers=2)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    calibration = [{"input_ids": batch} for batch in batches()]
    handle = surgery.rotate(model, calibration=calibration, learn={"steps": 2}, progress=False)
    assert len(handle.head_rotations) == heads
    handle.restore()
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[n], v) for n, v in state.items())


@pytest.mark.parametrize(
    "spec",
    [
        surgery.GridSpec(bits=4, symmetric=True, per_channel=True),
        surgery.GridSpec(bits=4, symmetric=False, group_size=32),
        surgery.GridSpec(bits=8, symmetric=True),
    ],
    ids=["per-channel", "groups", "per-tensor"],
)
def test_the_learning_forward_rounds_weights_as_quantize_does(spec):
    model = tiny_llama(layers=2)
    weight = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    handle = surgery.quantize(model, weights=spec, exclude="lm_head", progress=False)
    rounded = guards.current_value(model.model.layers[0].mlp.up_proj.weight).detach().clone()
    handle.restore()
    learned = learned_rotation.fake_quantized_weight(weight, spec)
    # torch's fused op (quantize) rounds x * (1 / scale), fake_quantize_dynamic x / scale: measured 0.1 %
    # of the values one step apart
    assert (learned != rounded).float().mean() < 0.01
    assert (learned - rounded).abs().max() <= weight.abs().max() / 7 + 1e-6  # at most one int4 step
