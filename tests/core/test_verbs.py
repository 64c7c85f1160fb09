"""The one door every verb goes through (surgery/core/verbs.py): specs, keywords, old spellings."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import surgery
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle
from surgery.core.verbs import VERBS, VerbCall, verb

PUBLIC_VERBS = {  # registered name -> the public function
    "prune": surgery.prune,
    "quantize": surgery.quantize,
    "awq": surgery.awq,
    "smooth": surgery.smooth,
    "rotate": surgery.rotate,
    "shrink": surgery.shrink,
    "finetune": surgery.finetune,
    "prune_experts": surgery.prune_experts,
    "low_rank_branch": surgery.low_rank_branch,
    "plan": surgery.plan,
    "sensitivity": surgery.sensitivity,
    "kv_cache": surgery.quantize_kv_cache,
    "rewrite": surgery.rewrite_inputs,
    "linear_experts": surgery.linear_experts,
}


def test_every_public_verb_is_declared_through_the_door():
    assert set(PUBLIC_VERBS) <= set(VERBS.names())
    for name, function in PUBLIC_VERBS.items():
        assert function.verb is VERBS.get(name)
        spec = function.verb.spec
        assert dataclasses.is_dataclass(spec) and spec.__dataclass_params__.frozen, name
        exported = getattr(surgery, spec.__name__, None)
        assert exported is spec, f"surgery.{spec.__name__} is not exported"


@pytest.mark.parametrize("name", [name for name in PUBLIC_VERBS if name != "linear_experts"])
def test_a_keyword_beside_a_spec_is_refused_naming_it_before_anything_runs(name):
    door = PUBLIC_VERBS[name].verb
    field = dataclasses.fields(door.spec)[-1]
    spec = _a_spec(door.spec)
    model = nn.Linear(4, 2)
    before = model.weight.detach().clone()
    article = "an" if door.spec.__name__[0] in "AEIOU" else "a"
    with pytest.raises(ConfigError, match=rf"^{name}\.{field.name}=.*: is given beside {article} {door.spec.__name__}"):
        PUBLIC_VERBS[name](model, spec, **{field.name: _default(field)})
    assert torch.equal(model.weight, before)
    assert not model._forward_hooks and not model._forward_pre_hooks


@pytest.mark.parametrize("name", list(PUBLIC_VERBS))
def test_an_unknown_keyword_is_one_line_naming_every_allowed_one(name):
    door = PUBLIC_VERBS[name].verb
    with pytest.raises(ConfigTypeError, match=rf"^{name}='colour': unknown keyword; allowed: ") as raised:
        PUBLIC_VERBS[name](nn.Linear(4, 2), colour=1)
    allowed = str(raised.value).split("allowed: ")[1].split(", ")
    assert allowed == door.allowed()
    assert [f.name for f in dataclasses.fields(door.spec)] == allowed[: len(dataclasses.fields(door.spec))]


@pytest.mark.parametrize("name", list(PUBLIC_VERBS))
def test_the_signature_shows_the_spec_fields_and_the_docstring_is_the_handlers(name):
    function = PUBLIC_VERBS[name]
    parameters = inspect.signature(function).parameters
    assert list(parameters)[0] in ("model", "quantized") or list(parameters)[0] == "model"
    assert set(f.name for f in dataclasses.fields(function.verb.spec)) <= set(parameters)
    assert "spec" in parameters
    assert function.__doc__ and function.__name__ in (name, function.verb.handler.__name__)


def test_a_verb_that_needs_calibration_says_so_before_touching_the_model():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    for function in (surgery.awq, surgery.smooth, surgery.rotate, surgery.shrink):
        with pytest.raises(ConfigError, match=rf"^{function.verb.name}\.calibration=None: .* needs calibration"):
            function(model)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_verb_without_an_offloaded_handler_refuses_an_offloaded_model_in_one_line(tmp_path):
    from tests.support_families import tiny_decoder

    tiny_decoder("llama").save_pretrained(tmp_path)
    with surgery.offloaded(tmp_path) as source:
        with pytest.raises(ConfigError, match=r"^shrink='an offloaded model': works on a model in memory"):
            surgery.shrink(source, 0.5, calibration=torch.ones(1, 4, dtype=torch.long))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda m, x: surgery.shrink(m, 0.5, example_inputs=x),
            r"shrink\(example_inputs=...\) is now shrink\(calibration=...\)",
        ),
        (
            lambda m, x: surgery.finetune(m, [(x, torch.zeros(2, dtype=torch.long))], epochs=0),
            "finetune: calibration given positionally",
        ),
        (
            lambda m, x: surgery.sensitivity(m, (0.5,), inputs=[x]),
            r"sensitivity\(inputs=...\) is now sensitivity\(calibration=...\)",
        ),
    ],
)
def test_old_spellings_still_work_and_warn_until_0_4(call, message):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.warns(DeprecationWarning, match=message) as caught:
        call(model, torch.randn(2, 4))
    assert "0.4" in str(caught[0].message)
    assert caught[0].filename == __file__  # the warning points at the caller's line


def test_an_old_name_and_its_new_one_together_are_refused():
    with pytest.raises(
        ConfigError, match=r"^shrink.example_inputs=.*: is calibration's old name: give calibration only"
    ):
        surgery.shrink(nn.Linear(4, 2), 0.5, example_inputs=torch.ones(1, 4), calibration=torch.ones(1, 4))


def test_none_in_the_spec_s_place_means_its_defaults():
    model = nn.Linear(8, 4)
    with surgery.quantize(model, None, weights=surgery.GridSpec(bits=4), progress=False) as handle:
        assert handle.weights["weight"].spec.bits == 4


def test_a_positional_setting_and_the_same_keyword_are_refused():
    with pytest.raises(ConfigError, match=r"^prune.amount=0.5: is given twice"):
        surgery.prune(nn.Linear(4, 2), 0.5, amount=0.25)
    with pytest.raises(ConfigTypeError, match=r"^prune=.*: takes nothing positionally after its PruneSpec"):
        surgery.prune(nn.Linear(4, 2), surgery.PruneSpec(), 0.5)


def test_a_verb_written_from_scratch_gets_the_whole_door():
    @dataclass(frozen=True)
    class ScaleSpec:
        factor: float = 1.0

        def __post_init__(self) -> None:
            if not isinstance(self.factor, (int, float)) or isinstance(self.factor, bool):
                raise ConfigTypeError("scale.factor", self.factor, "must be a number")

    @verb("scale_test", ScaleSpec, positional="factor", calibration="none")
    def scale(model: nn.Module, spec: ScaleSpec, call: VerbCall) -> Handle:
        """Multiply every weight by ``factor``."""
        handle = Handle("scale_test", model)
        originals = {name: p.detach().clone() for name, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(spec.factor)

        def put_back() -> None:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(originals[name])

        handle.add("put the weights back", put_back)
        return handle

    try:
        model = nn.Linear(4, 2)
        before = model.weight.detach().clone()
        with scale(model, 2.0):
            assert torch.equal(model.weight, before * 2)
        assert torch.equal(model.weight, before)
        with pytest.raises(ConfigError, match=r"^scale_test.factor=3: is given beside a ScaleSpec"):
            scale(model, ScaleSpec(2.0), factor=3)
        with pytest.raises(ConfigTypeError, match=r"^scale_test='calibration': unknown keyword"):
            scale(model, 2.0, calibration=[torch.ones(1, 4)])
        assert list(inspect.signature(scale).parameters) == ["model", "factor", "spec", "progress"]
    finally:
        VERBS.unregister("scale_test")


def _a_spec(cls: type) -> object:
    """A valid instance of ``cls`` (the verbs' specs whose defaults do not build one get a value)."""
    required = {"LowRankSpec": {"rank": 4}, "PlanSpec": {"budget": "4bpw"}}
    return cls(**required.get(cls.__name__, {}))


def _default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # type: ignore[misc]


def test_a_verb_declared_wrongly_is_refused_in_one_line():
    @dataclass(frozen=True)
    class Nothing:
        pass

    with pytest.raises(ConfigError, match=r"^verb 'bad_test' calibration='sometimes': must be one of required"):
        verb("bad_test", Nothing, calibration="sometimes")
    with pytest.raises(ConfigTypeError, match=r"^verb 'bad_test' spec=.*: must be a frozen dataclass"):
        verb("bad_test", dict)
    assert "bad_test" not in VERBS
