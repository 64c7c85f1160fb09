"""The per-layer options a plan chooses between: each a named :class:`Choice` that knows the
bits a weight of a given shape stores under it (values, scales and zero points, or kept values
and their index metadata) and how to apply itself to a set of layers through the public verbs
(:func:`surgery.quantize`, :func:`surgery.prune`), so every change comes back by its handle.

What the built-ins count (``out x in`` weight, ``n = out * in``):

- ``dense``: 16 bits a weight (the half-precision model a deployment holds), nothing done;
- ``int8``, ``fp8``: 8 bits a weight and one 16-bit scale per output channel;
- ``w4g128``, ``w3g128``: 4 (3) bits a weight, symmetric, one 16-bit scale per 128 inputs of
  each output (``ceil(in / 128)`` groups a row): 4 + 16/128 = 4.125 bits at whole groups;
- ``mxfp4``: 4 bits a weight, one 8-bit (E8M0) scale per 32 inputs: 4.25;
- ``nvfp4``: 4 bits a weight, one 8-bit (E4M3) scale per 16 inputs, and one 32-bit tensor
  scale: 4.5 (and a little);
- ``2:4``: half the weights kept at 16 bits, each with a 2-bit position in its group of four
  (NVIDIA's sparse metadata): (16 + 2) / 2 = 9 bits a weight;
- ``gguf:Q4_0``, ``gguf:Q4_1``, ``gguf:Q5_0``, ``gguf:Q5_1``, ``gguf:Q8_0``: llama.cpp's block
  types (``target="gguf:..."``'s grids), at a block's bytes: 18, 20, 22, 24, 34 bytes a block of
  32 weights (4.5, 5, 5.5, 6, 8.5 bits); ``gguf:Q3_K``, ``gguf:Q4_K``, ``gguf:Q5_K``,
  ``gguf:Q6_K``: 110, 144, 176, 210 bytes a super-block of 256 (3.4375, 4.5, 5.5, 6.5625 bits),
  for layers whose inputs are multiples of 256.

KV-cache choices (``target="kv_cache"``) are taken per attention module with ``k_proj`` and
``v_proj`` Linear layers. Their "shape" is ``(values cached per token, tokens)``: the key and
value projections' outputs, and the tokens the deployment caches (context x batch, the plan's
``kv_tokens``), since a cache's bytes grow with what is served, not with the weights:

- ``kv16``: 16 bits a cached value, nothing done;
- ``kv_int8``, ``kv_int4``: 8 (4) bits, symmetric, one static 16-bit scale per channel;
- ``kv_fp8``: fp8 e4m3, one static scale per projection (as vLLM's ``fp8`` cache).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle
from surgery.core.registry import Registry
from surgery.ops.export.formats.gguf.blocks import BLOCK_TYPES, BlockType
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.numerics.weight_methods import weight_method
from surgery.ops.quantization.kv_cache import projection_names, quantize_kv_cache
from surgery.ops.quantization.quantization import quantize
from surgery.ops.quantization.storage import element_bits, scale_bits
from surgery.ops.sparsity.pruning import prune

Shape = tuple[int, int]  # (outputs, inputs) of a weight; (values per token, tokens) of a KV cache
TARGETS = ("weight", "kv_cache")
Apply = Callable[[nn.Module, list[str], Any, str], Handle]  # (model, layers, calibration, method) -> handle
DENSE_BITS = 16  # a weight left as it is, counted at half precision
INDEX_BITS = 2  # an N:M kept value's position in its group of M (M = 4)


@dataclass(frozen=True)
class Choice:
    """One per-layer option: ``bits(shape)`` is what a weight of that shape stores under it (all
    of it: values, scales, zero points, index metadata); ``apply(model, layers, calibration,
    method)`` changes those layers through a public verb and returns its handle; ``fits(shape)``
    says whether the option can hold such a weight; ``method`` lists the weight methods it takes
    (``"rtn"`` by default; ``"gptq"``... for the integer grids). ``target="kv_cache"``: a choice
    for what an attention module caches; its layers are attention modules and its shape
    ``(values per token, tokens)``. ``reattach(model, layers, qparams)``, where set, puts back
    what baking cannot fold into weights (a cache's rounding) from saved activation parameters."""

    name: str
    bits: Callable[[Shape], float]
    apply: Apply
    fits: Callable[[Shape], bool] = lambda shape: True
    methods: tuple[str, ...] = ("rtn",)
    description: str = ""
    target: str = "weight"
    reattach: Callable[[nn.Module, list[str], dict[str, Tensor]], Handle] | None = None

    def bytes_of(self, shape: Shape) -> int:
        """Whole bytes a weight of ``shape`` stores under this choice."""
        return math.ceil(self.bits(shape) / 8)

    def bits_per_weight(self, shape: Shape) -> float:
        return self.bits(shape) / (shape[0] * shape[1])


CHOICES: Registry[Choice] = Registry("plan.choices", table=True)


def register_choice(choice: Choice, *, replace: bool = False) -> Choice:
    """Make ``choice`` available to :func:`surgery.plan` as ``choices=[choice.name, ...]`` (the
    built-ins are registered the same way)."""
    if not isinstance(choice, Choice):
        raise ConfigTypeError("register_choice.choice", choice, "must be a surgery.ops.planning.choices.Choice")
    if not isinstance(choice.name, str) or not choice.name or any(c.isspace() for c in choice.name):
        raise ConfigError("register_choice.name", choice.name, "must be a non-empty name without spaces")
    if choice.target not in TARGETS:
        raise ConfigError("register_choice.target", choice.target, f"must be one of {', '.join(TARGETS)}")
    return CHOICES.register(choice.name, choice, replace=replace)


def choice_named(name: object, field: str = "plan.choices") -> Choice:
    """The choice registered as ``name``; a one-line error naming the allowed ones otherwise."""
    if isinstance(name, str) and name in CHOICES:
        return CHOICES[name]
    raise ConfigError(field, name, f"must be one of {', '.join(CHOICES)}")


def grid_bits(spec: GridSpec) -> Callable[[Shape], float]:
    """Bits of a weight on ``spec``'s grid: its values, one scale (and zero point) per group,
    per output channel or per tensor, and nvfp4's 32-bit tensor scale."""

    def bits(shape: Shape) -> float:
        rows, columns = shape
        scales = rows * math.ceil(columns / spec.group_size) if spec.group_size else rows if spec.per_channel else 1
        extra = 32 if spec.format == "nvfp4" else 0
        return rows * columns * element_bits(spec) + scales * scale_bits(spec) + extra

    return bits


def grid_choice(name: str, spec: GridSpec, description: str = "") -> Choice:
    """A choice quantizing weights onto ``spec`` with :func:`surgery.quantize` (an integer grid
    also takes the caller's weight method: ``gptq``, ``gptaq``, ``autoround``)."""

    def apply(model: nn.Module, layers: list[str], calibration: Any, method: str) -> Handle:
        chosen = method if spec.format == "int" else "rtn"
        needs = weight_method(chosen).needs_calibration
        return quantize(
            model,
            weights=spec,
            method=chosen,
            select=layers,
            calibration=calibration if needs else None,
            progress=False,
        )

    methods = ("rtn", "gptq", "gptaq", "autoround") if spec.format == "int" else ("rtn",)
    return Choice(name, grid_bits(spec), apply, methods=methods, description=description)


def kv_choice(name: str, spec: GridSpec | None, description: str = "") -> Choice:
    """A KV-cache choice: the named attention modules' keys and values fake-quantized on
    ``spec`` (:func:`surgery.quantize_kv_cache`, static scales from the calibration batches), or
    kept at 16 bits (``spec=None``)."""

    def bits(shape: Shape) -> float:
        values, tokens = shape
        if spec is None:
            return values * tokens * DENSE_BITS
        scales = values if spec.per_channel else 2  # static: one per channel, or one per projection
        return values * tokens * element_bits(spec) + scales * scale_bits(spec)

    def apply(model: nn.Module, attention: list[str], calibration: Any, method: str) -> Handle:
        if spec is None:
            return Handle(name, model)
        if calibration is None:
            raise ConfigError("plan.calibration", None, f"{name} takes its static scales from calibration batches")
        return quantize_kv_cache(model, spec, calibration=calibration, attention=attention, progress=False)

    def reattach(model: nn.Module, attention: list[str], qparams: dict[str, Tensor]) -> Handle:
        layers = [layer for name in attention for layer in projection_names(name)]
        handle = quantize(model, weights=None, activations=spec, select=layers, qparams=qparams, progress=False)
        handle.kind = "kv_cache"
        return handle

    return Choice(
        name, bits, apply, description=description, target="kv_cache", reattach=None if spec is None else reattach
    )


def gguf_choice(kind: BlockType) -> Choice:
    """The choice ``gguf:TYPE``: the GGUF type's grid, counted at the type's bytes (a block of
    ``kind.super_block`` weights in ``kind.block_bytes``), for layers whose rows are whole blocks."""
    choice = grid_choice(
        f"gguf:{kind.name}",
        GridSpec(**kind.target),
        f"GGUF {kind.name}, {kind.block_bytes} B a block of {kind.super_block}",
    )
    return dataclasses.replace(
        choice,
        bits=lambda shape: shape[0] * shape[1] // kind.super_block * kind.block_bytes * 8,
        fits=lambda shape: shape[1] % kind.super_block == 0,
    )


def _dense(model: nn.Module, layers: list[str], calibration: Any, method: str) -> Handle:
    return Handle("dense", model)  # nothing done: restores to itself


def _two_four(model: nn.Module, layers: list[str], calibration: Any, method: str) -> Handle:
    return prune(model, 0.5, pattern="2:4", select=layers, progress=False)


def _builtins() -> None:
    """Register the built-in choices through :func:`register_choice`."""
    register_choice(Choice("dense", lambda s: s[0] * s[1] * DENSE_BITS, _dense, description="16-bit, unchanged"))
    channel = GridSpec(bits=8, symmetric=True, per_channel=True)
    register_choice(grid_choice("int8", channel, "int8, symmetric, per channel"))
    register_choice(grid_choice("w4g128", GridSpec(bits=4, symmetric=True, group_size=128), "int4, group 128"))
    register_choice(grid_choice("w3g128", GridSpec(bits=3, symmetric=True, group_size=128), "int3, group 128"))
    register_choice(grid_choice("fp8", GridSpec(format="fp8_e4m3", per_channel=True), "fp8 e4m3, per channel"))
    register_choice(grid_choice("mxfp4", GridSpec(format="mxfp4"), "fp4 e2m1, e8m0 scale per 32"))
    register_choice(grid_choice("nvfp4", GridSpec(format="nvfp4"), "fp4 e2m1, e4m3 scale per 16"))
    sparse_bits = lambda s: s[0] * s[1] / 2 * (DENSE_BITS + INDEX_BITS)  # noqa: E731
    register_choice(
        Choice("2:4", sparse_bits, _two_four, fits=lambda s: s[1] % 4 == 0, description="2:4 sparse, 16-bit kept")
    )
    for kind in BLOCK_TYPES.values():
        register_choice(gguf_choice(kind))
    register_choice(kv_choice("kv16", None, "KV cache at 16 bits, unchanged"))
    register_choice(kv_choice("kv_int8", channel, "KV cache int8, symmetric, static per channel"))
    kv4 = GridSpec(bits=4, symmetric=True, per_channel=True)
    register_choice(kv_choice("kv_int4", kv4, "KV cache int4, symmetric, static per channel"))
    register_choice(kv_choice("kv_fp8", GridSpec(format="fp8_e4m3"), "KV cache fp8 e4m3, static per projection"))


_builtins()
