"""Which tokens reached which expert: counts per expert, and a one-line refusal when an expert saw too
few for a method (:func:`surgery.core.routing.every_expert_calibrated` routes every token to each)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from surgery.core._compat import get_slot
from surgery.core.errors import ConfigError
from surgery.core.targets import routers_in
from surgery.ops.experts.layouts import fused_experts
from surgery.ops.experts.linear_experts import LinearExperts


def linear_experts_in(model: nn.Module) -> dict[str, LinearExperts]:
    """Every :class:`LinearExperts` in ``model`` by name."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LinearExperts)}


def moe_blocks(named: Mapping[str, nn.Module]) -> list[str]:
    """The mixture-of-experts blocks in ``named`` (its modules by name): those holding a :class:`LinearExperts`."""
    return [name for name, module in named.items() if any(isinstance(c, LinearExperts) for c in module.children())]


def gates_in(named: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """The routers and gates of every mixture-of-experts block in ``named`` (its modules by name): the
    children with a 2-D ``weight`` of their own beside a :class:`LinearExperts` (Mixtral's ``gate``,
    PhiMoE's ``router``, Qwen2-MoE's ``shared_expert_gate``). They read the block's input as its
    experts do, through ``F.linear`` on that weight or as a Linear, and stay float."""
    found: dict[str, nn.Module] = {}
    for name in moe_blocks(named):
        for local, child in named[name].named_children():
            weight = get_slot(child, "weight")
            if not isinstance(child, LinearExperts) and isinstance(weight, nn.Parameter) and weight.dim() == 2:
                found[f"{name}.{local}" if name else local] = child
    return found


def expert_inputs(name: str, experts: LinearExperts) -> list[str]:
    """The layers of every expert of ``experts`` (named ``name``) that read its input: ``gate_proj`` and
    ``up_proj`` (``up_proj`` alone when ungated)."""
    local = ["gate_proj", "up_proj"] if experts.layout.gated else ["up_proj"]
    return [f"{name}.{e}.{layer}" for e in range(len(experts)) for layer in local]


def experts_modules(model: nn.Module) -> list[str]:
    """The names of ``model``'s experts modules, fused or standing in as per-expert layers."""
    return sorted(set(linear_experts_in(model)) | set(fused_experts(model)))


def routers(model: nn.Module) -> list[str]:
    """The names of ``model``'s routers and gates (a layer with a weight beside an experts module)."""
    return sorted(routers_in(dict(model.named_modules()), None))


def refuse_experts(model: nn.Module, format_name: str, why: str) -> None:
    """Raise in one line when an export format cannot hold ``model``'s mixture-of-experts layers yet."""
    found = experts_modules(model)
    if found:
        raise ConfigError(
            "export.format",
            format_name,
            f"writes no mixture-of-experts layer yet ({found[0]}{' ...' if len(found) > 1 else ''}: {why}); "
            "format='torchao' holds them",
        )


def tokens_per_expert(model: nn.Module, counter: str = "routed") -> dict[str, list[int]]:
    """How many tokens each expert of each experts layer was sent by its router (``"routed"``) or ran
    on (``"seen"``: every token, calibrating every expert) since it was made per-expert layers."""
    return {name: list(getattr(module, counter)) for name, module in linear_experts_in(model).items()}


def since(before: dict[str, list[int]], now: dict[str, list[int]]) -> dict[str, list[int]]:
    """The counts of ``now`` less those of ``before``, expert by expert."""
    return {
        name: [n - b for n, b in zip(per, before.get(name, [0] * len(per)), strict=True)] for name, per in now.items()
    }


def check_tokens(
    counts: dict[str, list[int]], needed: int, field: str, method: str, *, layers: set[str] | None = None
) -> None:
    """Raise naming the experts that saw fewer than ``needed`` tokens (``counts`` as
    :func:`tokens_per_expert` gives them, for the calibration just run); with ``layers``, only the
    experts holding one of those layers (the ones a verb selected) need tokens."""

    def selected(name: str, e: int) -> bool:
        return layers is None or any(layer.startswith(f"{name}.{e}.") for layer in layers)

    short = [
        f"{name}.{e} ({n})"
        for name, per in counts.items()
        for e, n in enumerate(per)
        if n < needed and selected(name, e)
    ]
    if short:
        shown = ", ".join(short[:4]) + (f" and {len(short) - 4} more" if len(short) > 4 else "")
        raise ConfigError(
            field,
            shown,
            f"saw fewer than {needed} calibration token(s) each, too few for {method}; calibrate on more "
            "tokens, or run every token through every expert (with surgery.every_expert_calibrated(): ...)",
        )
