"""Surgery that survives training: masks and grids hold under every optimizer, right after step()."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery import GridSpec
from surgery.core.errors import ConfigError, ParameterReplacedError
from surgery.ops.numerics.fake_quant import fake_quantize
from surgery.testing import global_hook_counts, module_hook_counts, snapshot, snapshot_differences

OPTIMIZERS = [
    ("SGD", {"momentum": 0.9, "weight_decay": 0.1}),
    ("Adam", {}),
    ("AdamW", {"weight_decay": 0.1}),
    ("Adagrad", {}),
    ("RMSprop", {"momentum": 0.5}),
]
IMPLEMENTATIONS = ["fused", "foreach", "for-loop"]
CASES = [
    pytest.param(name, kwargs, impl, id=f"{name}-{impl}")
    for name, kwargs in OPTIMIZERS
    for impl in IMPLEMENTATIONS
    if not (name == "RMSprop" and impl == "fused")
]  # RMSprop has no fused kernel


def gradient_hooks(model: nn.Module) -> int:
    """Tensor hooks on the model's parameters (on gradients, and after their accumulation)."""
    return sum(len(p._backward_hooks or {}) + len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def make_optimizer(model: nn.Module, name: str, kwargs: dict, implementation: str) -> torch.optim.Optimizer:
    flag = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[implementation]
    return getattr(torch.optim, name)(model.parameters(), lr=0.05, **kwargs, **flag)


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, steps: int = 3) -> None:
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def pruned_values(model: nn.Module, masks: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([model.get_parameter(name).detach()[~mask] for name, mask in masks.items()])


@pytest.mark.parametrize("name,kwargs,implementation", CASES)
def test_masks_hold_right_after_each_optimizer_step_before_any_forward(
    convnet, image_input, name, kwargs, implementation
):
    handle = surgery.prune(convnet, 0.5, progress=False)
    masks = handle.masks()
    optimizer = make_optimizer(convnet, name, kwargs, implementation)
    weights_before = {n: convnet.get_parameter(n).detach().clone() for n in masks}
    optimizer.zero_grad()
    convnet.train()(image_input).square().mean().backward()
    optimizer.step()  # no forward after this: readers outside forward see the weights as they are
    assert not pruned_values(convnet, masks).any()
    assert any(not torch.equal(convnet.get_parameter(n).detach(), w) for n, w in weights_before.items()), (
        "the step must have trained the kept entries"
    )
    for state in optimizer.state.values():  # gradients of pruned entries are masked: no momentum builds up
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() and value.shape == convnet.conv1.weight.shape:
                assert not value[~masks["conv1.weight"]].any(), key
    train_steps(convnet, optimizer, image_input)
    assert not pruned_values(convnet, masks).any()
    assert handle.sparsity() == pytest.approx(0.5, abs=0.01)
    handle.bake()
    baked_sparsity = sum(int((convnet.get_parameter(n) == 0).sum()) for n in masks) / sum(
        m.numel() for m in masks.values()
    )
    assert (
        baked_sparsity
        == pytest.approx(
            handle_sparsity := 1 - sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values()),
            abs=1e-9,
        )
        and handle_sparsity >= 0.5
    )
    assert sum(module_hook_counts(convnet).values()) == 0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_quantization_grid_holds_right_after_each_step(mlp, mlp_input, implementation):
    handle = surgery.quantize(mlp, weights=GridSpec(bits=4, symmetric=True, per_channel=True), progress=False)
    optimizer = make_optimizer(mlp, "AdamW", {}, implementation)
    train_steps(mlp, optimizer, mlp_input, steps=2)
    for name, q in handle.weights.items():
        weight = mlp.get_parameter(name).detach()
        assert torch.equal(fake_quantize(weight, q.scale, q.zero_point, q.axis, q.spec), weight), name
    handle.restore()


def test_restore_and_bake_remove_every_gradient_and_optimizer_hook(convnet, image_input):
    before_globals, before = global_hook_counts(), snapshot(convnet)
    handle = surgery.compose(surgery.prune(convnet, 0.5, progress=False), surgery.quantize(convnet, progress=False))
    assert global_hook_counts()["_global_optimizer_post_hooks"] == before_globals["_global_optimizer_post_hooks"] + 2
    masked = len(handle.handles[0].masks())
    assert gradient_hooks(convnet) == masked  # one per masked weight
    train_steps(convnet, torch.optim.SGD(convnet.parameters(), lr=0.01), image_input, steps=1)
    handle.restore()
    assert global_hook_counts() == before_globals
    diffs = snapshot_differences(before, snapshot(convnet))
    assert all(d.startswith("tensor") for d in diffs)  # trained values differ; no hook of any kind is left
    handle = surgery.prune(convnet, 0.5, progress=False)
    handle.bake()
    assert global_hook_counts() == before_globals
    assert gradient_hooks(convnet) == 0


def test_a_model_dropped_with_surgery_attached_takes_its_optimizer_hook_with_it(mlp_factory):
    import gc

    gc.collect()
    before = global_hook_counts()["_global_optimizer_post_hooks"]
    model = mlp_factory()
    surgery.prune(model, 0.5, progress=False)  # the handle is not kept
    assert global_hook_counts()["_global_optimizer_post_hooks"] == before + 1
    del model
    gc.collect()
    assert global_hook_counts()["_global_optimizer_post_hooks"] == before


def test_a_frozen_weight_gets_no_gradient_hook_and_still_holds_after_a_step(mlp, mlp_input):
    mlp[0].weight.requires_grad_(False)
    with surgery.prune(mlp, 0.5, progress=False) as handle:
        masks = handle.masks()
        mlp[0].weight.requires_grad_(True)  # unfrozen after pruning: no gradient hook, the step hook still masks
        train_steps(mlp, torch.optim.Adam(mlp.parameters(), lr=0.1, fused=True), mlp_input, steps=2)
        assert not pruned_values(mlp, masks).any()


def test_an_edit_through_data_is_invisible_until_enforce(mlp, mlp_input):
    with surgery.prune(mlp, 0.5, progress=False) as handle:
        pruned = ~handle.masks()["0.weight"]
        mlp[0].weight.data.fill_(1.0)  # .data bypasses the version counter: no hook can see it
        assert mlp[0].weight.detach()[pruned].all()
        handle.enforce()
        assert not mlp[0].weight.detach()[pruned].any()
        assert mlp[0].weight.detach()[~pruned].eq(1.0).all()


def test_load_state_dict_with_assign_is_detected_and_enforce_carries_the_surgery_over(mlp_factory, mlp_input):
    model, trained = mlp_factory(), mlp_factory()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)
    before = snapshot(model)
    handle = surgery.prune(model, 0.5, progress=False)
    pruned = ~handle.masks()["0.weight"]
    model.load_state_dict(trained.state_dict(), assign=True)
    with pytest.raises(ParameterReplacedError, match=r"0\.weight was replaced by a new object.*enforce\(\)"):
        model(mlp_input)
    handle.enforce()
    assert not model[0].weight.detach()[pruned].any()
    assert torch.equal(model[0].weight.detach()[~pruned], trained[0].weight.detach()[~pruned])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)  # made after the load: the new objects
    train_steps(model, optimizer, mlp_input, steps=2)
    assert not model[0].weight.detach()[pruned].any()
    assert model[0].weight.grad[pruned].eq(0).all()  # the gradient hook moved to the new parameter
    handle.restore()
    assert gradient_hooks(model) == 0
    assert "tensor param:0.weight changed" in snapshot_differences(
        before, snapshot(model)
    )  # trained, not restored to old


def test_enforce_refuses_a_replacement_of_another_shape(mlp, mlp_input):
    handle = surgery.prune(mlp, 0.5, progress=False)
    original = mlp[0].weight
    mlp[0].weight = nn.Parameter(torch.zeros(3, 8))
    with pytest.raises(ConfigError, match=r"enforce='0\.weight': was replaced by a parameter of shape"):
        handle.enforce()
    with pytest.raises(ParameterReplacedError, match=r"prune: 0\.weight was replaced by a new object"):
        handle.restore()  # refused before anything changes: restoring into the old object would undo nothing
    assert handle.state == "attached"
    mlp[0].weight = original
    handle.restore()


def test_hugging_face_trainer_with_default_arguments_keeps_half_the_weights_zero(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    handle = surgery.prune(model, 0.5, select="bert.encoder.**", progress=False)
    masks = handle.masks()
    generator = torch.Generator().manual_seed(0)
    rows = [
        {"input_ids": torch.randint(0, 64, (12,), generator=generator), "labels": torch.tensor(i % 2)}
        for i in range(32)
    ]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=8,
        report_to=[],
        save_strategy="no",
        learning_rate=1e-2,
    )
    assert args.optim.value == "adamw_torch_fused"  # the default optimizer on this torch: fused, no version bumps
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    weights_before = {n: model.get_parameter(n).detach().clone() for n in masks}
    trainer.train()
    assert all(not torch.equal(model.get_parameter(n).detach(), w) for n, w in weights_before.items())
    assert not pruned_values(model, masks).any()
    assert handle.sparsity() == pytest.approx(0.5, abs=0.01)
    handle.bake()
    zeros = sum(int((model.get_parameter(n) == 0).sum()) for n in masks) / sum(m.numel() for m in masks.values())
    assert zeros >= 0.5
    assert gradient_hooks(model) == 0


def test_a_timm_vision_transformer_trains_with_masks_and_quantization_aware_training():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=4)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    before = snapshot(model)
    pruned = surgery.prune(model, 0.5, select=nn.Linear, progress=False)
    trained = surgery.quantize(
        model, weights=GridSpec(bits=4, symmetric=True, per_channel=True), select=nn.Linear, progress=False, train=True
    )
    masks = pruned.masks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for _ in range(2):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model.train()(x), y).backward()
        optimizer.step()
        assert not pruned_values(model, masks).any()  # right after the fused step
    surgery.compose(pruned, trained).restore()
    diffs = snapshot_differences(before, snapshot(model))
    assert diffs and not any(name.split(":")[1] in masks for name in diffs if name.startswith("tensor param:"))
    assert gradient_hooks(model) == 0
