"""How a fused experts module stores its experts: which 3-D parameters, in which axis order, gate and
up concatenated or interleaved, with biases or not.

transformers 5 keeps a mixture-of-experts layer's experts in one module holding 3-D parameters
(``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``; GPT-OSS transposed, ``(E, H, 2I)``, its gate
and up interleaved). The classes decorated with transformers' ``use_experts_implementation`` say so
in attributes (``is_transposed``, ``is_concatenated``, ``has_bias``, ``has_gate``,
``has_post_expert_norm``); :func:`fused_layout` reads them, so every such family is answered by one
rule. A class that stores experts another way registers its own reader in :data:`LAYOUT_READERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from surgery.core.errors import ConfigError
from surgery.core.registry import Registry

EXPERT_AXES = ("gate_up_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class FusedLayout:
    """The storage of one fused experts module.

    ``transposed``: weights are ``(E, in, out)`` (GPT-OSS, Llama 4) instead of ``(E, out, in)``.
    ``concatenated``: the gate rows come first, then the up rows; else they alternate (gate at even
    positions). ``gated``: a ``gate_up_proj`` (else an ``up_proj`` alone). ``bias``: ``*_bias``
    parameters of shape ``(E, out)`` beside each weight. ``all_tokens``: every token runs through
    every expert (Llama 4's shared-weight scheme), which per-expert statistics cannot follow.
    """

    num_experts: int
    transposed: bool = False
    concatenated: bool = True
    gated: bool = True
    bias: bool = False
    post_norm: bool = False
    all_tokens: bool = False

    @property
    def up_name(self) -> str:
        """The parameter holding the input projections: ``gate_up_proj`` or ``up_proj``."""
        return "gate_up_proj" if self.gated else "up_proj"

    def matrix(self, weight: Tensor, expert: int) -> Tensor:
        """Expert ``expert``'s weight as a Linear holds it, ``(out, in)`` (a view)."""
        one = weight[expert]
        return one.transpose(0, 1) if self.transposed else one

    def halves(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Split ``gate_up`` rows (or a bias) into gate and up, as the layout stores them."""
        if self.concatenated:
            gate, up = rows.chunk(2, dim=0)
            return gate, up
        return rows[0::2], rows[1::2]


LAYOUT_READERS: Registry[Callable[[nn.Module], FusedLayout | None]] = Registry("experts layout")


def fused_layout(module: nn.Module) -> FusedLayout | None:
    """The layout of ``module`` if it is a fused experts module, else ``None``.

    Example:
        >>> fused_layout(model.model.layers[0].mlp.experts).num_experts
        8
    """
    for name in LAYOUT_READERS:
        layout = LAYOUT_READERS.get(name)(module)
        if layout is not None:
            return layout
    return None


def fused_experts(model: nn.Module) -> dict[str, FusedLayout]:
    """Every fused experts module in ``model`` by name, with its layout."""
    found = {}
    for name, module in model.named_modules():
        layout = fused_layout(module)
        if layout is not None:
            found[name] = layout
    return found


def _decorated(module: nn.Module) -> FusedLayout | None:
    """transformers' ``use_experts_implementation`` classes: the layout is in their attributes."""
    flags = ("is_transposed", "is_concatenated", "has_bias", "has_gate")
    if not all(hasattr(module, flag) for flag in flags) or not hasattr(module, "num_experts"):
        return None
    gated = bool(module.has_gate)
    weight = getattr(module, "gate_up_proj" if gated else "up_proj", None)
    if (
        not isinstance(weight, Tensor)
        or weight.dim() != 3
        or not isinstance(getattr(module, "down_proj", None), Tensor)
    ):
        return None
    return FusedLayout(
        num_experts=int(module.num_experts),
        transposed=bool(module.is_transposed),
        concatenated=bool(module.is_concatenated),
        gated=gated,
        bias=bool(module.has_bias),
        post_norm=bool(getattr(module, "has_post_expert_norm", False)),
    )


def _all_tokens(module: nn.Module) -> FusedLayout | None:
    """Llama 4's experts: fused, transposed, every token through every expert pre-scaled by its
    router score (so an expert sees no routed subset to gather statistics from)."""
    if type(module).__name__ != "Llama4TextExperts":
        return None
    return FusedLayout(num_experts=int(module.num_experts), transposed=True, all_tokens=True)


LAYOUT_READERS.register("use_experts_implementation", _decorated)
LAYOUT_READERS.register("llama4", _all_tokens)


def check_splittable(name: str, layout: FusedLayout, module: nn.Module) -> None:
    """Raise in one line when ``module``'s experts cannot be made per-expert layers."""
    if layout.all_tokens:
        raise ConfigError(
            "experts",
            f"{name} ({type(module).__name__})",
            "runs every token through every expert pre-scaled by its router score; per-expert "
            "layers are not supported for it (exclude it)",
        )
