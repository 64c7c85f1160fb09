"""Build-time surgery: surgery.ops.build.intercept and surgery.ops.build.rules on real constructors."""

from __future__ import annotations

import threading

import pytest
import timm
import torch
import torchvision
from support import Passthrough  # tests/support.py
from torch import nn

import surgery
from surgery.ops.build import rules
from surgery.testing import global_hook_counts


class Tied(nn.Module):
    """A tiny language-model head whose output projection shares the embedding weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4), persistent=False)

    def forward(self, tokens):
        return self.head(self.embed(tokens) * self.scale)


class Gain(nn.Module):
    """A module whose parameter is not re-initialised after registration."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))


def seeded(build, seed: int = 0):
    torch.manual_seed(seed)
    return build().eval()


def registration_hooks() -> int:
    counts = global_hook_counts()
    return sum(counts[k] for k in counts if "registration" in k)


TORCHVISION = ["resnet18", "mobilenet_v3_small", "efficientnet_b0", "squeezenet1_0", "convnext_tiny", "regnet_x_400mf"]


@pytest.mark.parametrize("name", TORCHVISION)
def test_identity_wrap_is_bit_identical_on_torchvision_families(name):
    build = lambda: torchvision.models.get_model(name, weights=None)  # noqa: E731
    plain = seeded(build)
    with surgery.intercept(rules.wrap((nn.Conv2d, nn.Linear), Passthrough)) as log:
        wrapped = seeded(build)
    assert len(log) > 0 and all(event.new_type == "Passthrough" for event in log)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(plain(x), wrapped(x))


@pytest.mark.parametrize("name", ["resnet18", "vit_tiny_patch16_224", "efficientnet_b0"])
def test_timm_models_swap_and_identity_wrap(name):
    build = lambda: timm.create_model(name, pretrained=False)  # noqa: E731
    plain = seeded(build)
    with surgery.intercept(rules.wrap(nn.Linear, Passthrough)):
        wrapped = seeded(build)
    size = 224 if "vit" in name else 64
    x = torch.randn(1, 3, size, size)
    with torch.no_grad():
        assert torch.equal(plain(x), wrapped(x))
    with surgery.intercept(rules.swap((nn.ReLU, nn.GELU, nn.SiLU), lambda old: nn.Hardswish())) as log:
        swapped = seeded(build)
    assert log, "timm models use at least one of these activations"
    assert not any(
        isinstance(m, (nn.ReLU, nn.GELU, nn.SiLU)) for m in swapped.modules() if not isinstance(m, nn.Hardswish)
    )


def test_swap_events_have_qualified_names_and_types():
    with surgery.intercept(rules.swap(nn.ReLU, lambda old: nn.SiLU())) as log:
        model = torchvision.models.resnet18()
    names = [event.name for event in log]
    assert names[0] == "relu" and "layer4.1.relu" in names and len(names) == 9
    assert {(e.kind, e.old_type, e.new_type, e.root) for e in log} == {("swap", "ReLU", "SiLU", "ResNet")}
    for name in names:
        assert isinstance(model.get_submodule(name), nn.SiLU)


def test_wrapped_module_is_not_wrapped_again():
    with surgery.intercept(rules.wrap(nn.Linear, Passthrough)) as log:
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        model.alias = model[0]  # the same (already wrapped) module registered a second time
    assert isinstance(model[0], Passthrough) and isinstance(model[0].inner, nn.Linear)
    assert model.alias is model[0] and len(log) == 1


class TracedBatchNorm(nn.BatchNorm2d):
    """A BatchNorm subclass the constructor's own init code must still reach."""


def test_model_init_code_runs_on_what_the_rules_put_in():
    def fresh_norm(old: nn.BatchNorm2d) -> nn.BatchNorm2d:
        norm = TracedBatchNorm(old.num_features)
        with torch.no_grad():
            norm.weight.fill_(7.0)  # ResNet's init loop must overwrite this
        return norm

    with surgery.intercept(rules.swap(nn.BatchNorm2d, fresh_norm)):
        model = torchvision.models.resnet18(zero_init_residual=True)
    block = model.layer1[0]
    assert isinstance(block.bn2, TracedBatchNorm)
    assert torch.count_nonzero(block.bn2.weight) == 0  # zero_init_residual reached the swapped BN
    assert torch.equal(block.bn1.weight, torch.ones(64))  # and so did the init loop


def test_parameter_rules_cast_freeze_reinit_and_tied_weights_stay_shared():
    with surgery.intercept(
        rules.on_parameter("weight", rules.cast(torch.float64)), rules.on_parameter(nn.Embedding, rules.freeze())
    ) as log:
        model = Tied()
    assert model.head.weight is model.embed.weight  # tying survived: transformed once
    assert model.embed.weight.dtype == torch.float64 and not model.embed.weight.requires_grad
    # head's own weight, created in nn.Linear.__init__, is cast too before the tie replaces it
    assert [(e.name, e.rule) for e in log] == [
        ("embed.weight", "parameter('weight')"),
        ("embed.weight", "parameter(Embedding)"),
        ("head.weight", "parameter('weight')"),
    ]
    with surgery.intercept(rules.on_parameter("gain", rules.reinit(nn.init.zeros_))):
        zeroed = Gain()
    assert torch.count_nonzero(zeroed.gain) == 0 and isinstance(zeroed.gain, nn.Parameter)
    with surgery.intercept(rules.on_parameter("weight", rules.reinit(nn.init.zeros_))):
        linear = nn.Linear(3, 3)
    assert torch.count_nonzero(linear.weight) > 0  # documented: Linear's reset_parameters() runs after


def test_buffer_rules_keep_persistence():
    with surgery.intercept(rules.on_buffer("scale", lambda b: b * 2)) as log:
        model = Tied()
    assert torch.equal(model.scale, torch.full((4,), 2.0))
    assert "scale" not in model.state_dict()  # still non-persistent
    assert [e.name for e in log] == ["scale"]


def test_building_on_the_meta_device_plans_surgery_without_memory():
    with torch.device("meta"), surgery.intercept(rules.swap(nn.GELU, lambda old: nn.SiLU())) as log:
        model = torchvision.models.vit_b_16()
    assert all(p.is_meta for p in model.parameters())
    assert len(log) == 12 and log[0].name == "encoder.layers.encoder_layer_0.mlp.1"


def test_hooks_exist_only_inside_the_block_and_are_removed_on_exceptions():
    assert registration_hooks() == 0
    with pytest.raises(RuntimeError, match="boom"), surgery.intercept(rules.swap(nn.ReLU, lambda old: nn.SiLU())):
        assert registration_hooks() == 3
        raise RuntimeError("boom")
    assert registration_hooks() == 0
    after = nn.Sequential(nn.ReLU())
    assert isinstance(after[0], nn.ReLU)


def test_nesting_inner_rules_apply_and_outer_rules_still_hold_after():
    outer = rules.swap(nn.ReLU, lambda old: nn.SiLU())
    inner = rules.swap(nn.ReLU, lambda old: nn.GELU())
    with surgery.intercept(outer) as outer_log:
        with surgery.intercept(inner) as inner_log:
            first = nn.Sequential(nn.ReLU(), nn.Tanh())
            assert registration_hooks() == 3  # one set of global hooks, however deep
        second = nn.Sequential(nn.ReLU())
    assert isinstance(first[0], nn.GELU) and isinstance(second[0], nn.SiLU)
    assert [e.new_type for e in inner_log] == ["GELU"] and [e.new_type for e in outer_log] == ["SiLU"]
    assert registration_hooks() == 0


def test_a_model_built_in_another_thread_is_untouched():
    started, release = threading.Event(), threading.Event()
    built: dict[str, nn.Module] = {}

    def other_thread():
        started.wait(10)
        built["model"] = nn.Sequential(nn.ReLU(), nn.Linear(2, 2))
        release.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with (
        pytest.warns(surgery.RuleNeverFiredWarning, match=r"wrap\(Linear\) never fired"),
        surgery.intercept(rules.swap(nn.ReLU, lambda old: nn.SiLU()), rules.wrap(nn.Linear, Passthrough)),
    ):
        started.set()
        assert release.wait(10)
        mine = nn.Sequential(nn.ReLU())  # the other thread's Linear does not count as a firing
    worker.join()
    assert isinstance(built["model"][0], nn.ReLU) and isinstance(built["model"][1], nn.Linear)
    assert isinstance(mine[0], nn.SiLU)


def test_factory_returning_a_non_module_is_a_clear_error():
    with pytest.raises(surgery.InterceptError, match=r"swap\(ReLU\).*relu.*nn.Module"):
        with surgery.intercept(rules.swap(nn.ReLU, lambda old: 3)):
            torchvision.models.resnet18()
    assert registration_hooks() == 0


def test_a_predicate_that_raises_names_the_rule_and_the_module():
    def picky(parent, name, child):
        raise KeyError("no")

    with pytest.raises(surgery.InterceptError, match=r"wrap\(picky\).*match.*conv1"):
        with surgery.intercept(rules.wrap(picky, Passthrough)):
            torchvision.models.resnet18()
    assert registration_hooks() == 0


def test_casting_a_trainable_parameter_to_integers_is_refused():
    with pytest.raises(surgery.InterceptError, match=r"weight.*requires grad"):
        with surgery.intercept(rules.on_parameter("weight", lambda p: p.detach().to(torch.int8))):
            nn.Linear(2, 2)
    assert registration_hooks() == 0


def test_rules_reject_bad_arguments():
    with pytest.raises(TypeError, match="match"):
        rules.swap(3, lambda old: old)
    with pytest.raises(TypeError, match="not a rule"), surgery.intercept(nn.ReLU):
        pass
    assert registration_hooks() == 0


def test_the_root_module_is_never_swapped():
    with surgery.intercept(rules.swap(nn.Sequential, lambda old: nn.Identity())) as log:
        root = nn.Sequential(nn.Sequential(nn.ReLU()))
    assert type(root) is nn.Sequential and isinstance(root[0], nn.Identity) and len(log) == 1


def test_a_failed_build_keeps_no_half_built_module_alive():
    import gc
    import weakref

    seen: list[weakref.ref] = []

    def explode(old: nn.Module) -> nn.Module:
        seen.append(weakref.ref(old))
        raise ValueError("no factory today")

    try:
        with surgery.intercept(rules.swap(nn.ReLU, explode)):
            torchvision.models.resnet18()
    except surgery.InterceptError as err:
        assert "swap(ReLU)" in str(err) and "relu" in str(err)
    gc.collect()
    assert seen and seen[0]() is None  # neither the log nor the hooks hold the partial model
    assert registration_hooks() == 0


def test_a_rule_that_never_fires_warns_and_strict_raises():
    """Before: a rule that matched nothing (swap(nn.GELU) on a model with its own GELU class) was silent."""
    never, fires = rules.swap(nn.GELU, lambda old: nn.ReLU()), rules.swap(nn.ReLU, lambda old: nn.SiLU())
    with pytest.warns(surgery.RuleNeverFiredWarning) as caught, surgery.intercept(never, fires):
        nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert [str(w.message).split(":")[0] for w in caught] == ["build rule swap(GELU) never fired"]
    with pytest.raises(surgery.RuleNeverFiredError, match=r"swap\(GELU\) never fired") as raised:
        with surgery.intercept(never, strict=True):
            nn.Sequential(nn.ReLU())
    assert raised.value.rule is never


def test_parameter_rules_count_as_fired_when_their_action_ran_and_errors_are_not_hidden(recwarn):
    with surgery.intercept(rules.on_parameter("weight", rules.freeze()), strict=True):
        model = nn.Linear(2, 2)
    assert not model.weight.requires_grad
    with pytest.raises(RuntimeError, match="inside the block"):  # the block's own error, no never-fired report
        with surgery.intercept(rules.swap(nn.GELU, lambda old: nn.ReLU()), strict=True):
            raise RuntimeError("inside the block")
    assert not [w for w in recwarn if issubclass(w.category, surgery.RuleNeverFiredWarning)]


def small() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU())


def test_an_asyncio_task_without_a_block_is_untouched_while_another_task_holds_one():
    """Before: blocks were per thread, so task B's plain build got task A's GELU across A's await."""
    import asyncio

    async def holder(opened: asyncio.Event, done: asyncio.Event) -> str:
        with surgery.intercept(rules.swap(nn.ReLU, lambda old: nn.GELU())):
            opened.set()
            await done.wait()
            return type(small()[1]).__name__

    async def plain(opened: asyncio.Event, done: asyncio.Event) -> str:
        await opened.wait()
        built = type(small()[1]).__name__
        done.set()
        return built

    async def both() -> list[str]:
        opened, done = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(holder(opened, done), plain(opened, done))

    assert asyncio.run(both()) == ["GELU", "ReLU"]


def test_a_block_closed_from_another_thread_never_applies_again():
    """Before: a block opened in a generator on thread T1 and closed from the main thread stayed
    on T1's stack, and T1's later plain builds were swapped whenever any thread held a block."""
    import threading

    def block():
        with surgery.intercept(rules.swap(nn.ReLU, lambda old: nn.GELU())):
            yield

    opened, closed, other_open, release = (threading.Event() for _ in range(4))
    held, built = {}, {}

    def first() -> None:
        generator = block()
        next(generator)
        held["generator"] = generator
        opened.set()
        closed.wait()
        other_open.wait()
        built["after"] = type(small()[1]).__name__

    def other() -> None:
        with surgery.intercept(rules.on_buffer("nothing", rules.freeze())):
            other_open.set()
            release.wait()

    thread = threading.Thread(target=first)
    thread.start()
    opened.wait()
    held.pop("generator").close()  # the block's exit runs here, in the main thread
    closed.set()
    keeper = threading.Thread(target=other)
    with pytest.warns(surgery.RuleNeverFiredWarning):
        keeper.start()
        thread.join()
        release.set()
        keeper.join()
    assert built["after"] == "ReLU"
