"""``surgery.rotate``: QuaRot-style random Hadamard rotations fused into a residual-stream model,
restorably. The rotated model computes the same function; its activations lose their outlier
channels, so W4A8 and W4A4 quantization lose much less.

A Llama-style model adds every block's output to a residual stream that RMSNorm normalises
before each block reads it. RMSNorm without its weight is rotation invariant, so with an
orthogonal ``Q`` (a random Hadamard matrix: ``H / sqrt(n)`` with random signs on its columns):

1. each RMSNorm's weight is folded into the layers reading its output (their input columns
   scaled), and the norm's weight set to one;
2. the embeddings write ``x Q`` instead of ``x``; every layer reading the stream (after a norm)
   takes ``W Q``; every layer writing to it (attention and MLP outputs) gives ``Qᵀ W`` (and
   ``Qᵀ b``), so the stream carries ``x Q`` throughout and the head reads it back;
3. with ``online=True``, a forward-pre hook rotates the inputs of each layer that writes to the
   stream from another width (``down_proj``: ``x H``, its weight ``W H``), so its inputs lose
   their outliers too. ``H`` is block-diagonal with Hadamard blocks of the largest power of two
   dividing the width (QuaRot uses a full Hadamard of that order).

A mixture-of-experts block reads the stream through its router (a raw weight Parameter, or a
Linear) and every expert's input layers, and writes it through every expert's ``down_proj``
(made Linear layers while the verb is attached): they are readers and writers like any other.

With ``learn=``, the stream's rotation (and each attention's per-head value rotation) is
trained from the Hadamard through the quantized forward first, as SpinQuant does
(:mod:`~surgery.ops.equivalence.learned_rotation`), then fused the same way.

The model is checked to compute what it did (float32 rounding) on a sample batch; a model this
cannot rotate (a LayerNorm, which subtracts the mean; a stream layer the trace cannot place) is
refused in one line naming the layer, and nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from surgery.core import guards
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle
from surgery.core.inputs import Inputs, batches, evaluating
from surgery.core.sequential import find_blocks, materialise
from surgery.core.transforms import attach_all
from surgery.core.verbs import VerbCall, verb
from surgery.ops.equivalence.head_rotation import Heads, find_heads, rotate_heads
from surgery.ops.equivalence.learned_rotation import LearnSpec, learn_rotation
from surgery.ops.equivalence.smoothing import Rescaled, find_pairs
from surgery.ops.experts.linearizing import with_linear_experts
from surgery.ops.offload.offloaded_compression import OffloadedCompression, OffloadedVerb, compress_offloaded
from surgery.ops.offload.offloading import Offloaded


class Rotated(Rescaled):
    """A one-time rewrite of a parameter to its rotated values."""

    kind = "rotate"


class RotateHandle(Handle):
    """Handle returned by :func:`rotate`: ``width`` of the stream, ``readers``, ``writers``,
    ``embeddings``, ``online`` (layers whose inputs a hook rotates), ``rotation`` (the fused
    orthogonal matrix, random Hadamard or learned) and ``head_rotations`` (attention name → its
    learned per-head value rotation, SpinQuant's R2; empty unless learned with ``heads``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__("rotate", model)
        self.width = 0
        self.readers: list[str] = []
        self.writers: list[str] = []
        self.embeddings: list[str] = []
        self.online: list[str] = []
        self.rotation: Tensor | None = None
        self.head_rotations: dict[str, Tensor] = {}

    def outside_weights(self) -> list[str]:
        if not self.online or self.state != "attached":
            return []
        return [f"the online Hadamard before {len(self.online)} layer(s) (e.g. {self.online[0]}), a hook"]

    def bake(self) -> nn.Module | None:
        if self.online and self.state == "attached":
            raise ConfigError(
                "rotate.online",
                self.online[0],
                "its inputs are rotated by a hook that no weight can absorb (the product of two "
                "layers' outputs feeds it); keep the handle attached, or rotate with online=False to bake",
            )
        return super().bake()


def hadamard(n: int, seed: int = 0) -> Tensor:
    """An orthogonal n×n matrix: Sylvester Hadamard blocks of the largest power of two dividing
    ``n``, on the diagonal, scaled to unit norm, with random signs on the columns (seeded)."""
    block = n & -n  # the largest power of two dividing n
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = torch.block_diag(*[h] * (n // block)) / block**0.5
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return h * signs.to(h.dtype)


STREAM = ""  # the residual stream's rotation among a learned rotation's matrices (the others: attentions')


class _RotationSites(NamedTuple):
    """Where a rotation acts: the stream's ``width``, norm → readers ``pairs``, each reader's
    norm, the ``writers``, the ``embeddings``, and the first batch (traced and checked)."""

    width: int
    pairs: dict[str, list[str]]
    readers: dict[str, str]
    writers: list[str]
    embeddings: list[str]
    first: Any


def _find_sites(model: nn.Module, calibration: Inputs, online: Any) -> _RotationSites:
    """The layers a rotation of ``model``'s residual stream changes, traced on the first batch."""
    if not isinstance(online, bool):
        raise ConfigError("rotate.online", online, "must be true or false")
    first = next(iter(batches(calibration, "rotate.calibration")), None)
    if first is None:
        raise ConfigError("rotate.calibration", "0 batches", "must hold at least one batch")
    named = dict(model.named_modules())
    width, embeddings = _stream(model, named)
    pairs = {  # norms inside a layer at another width (MLA's q_a_layernorm) do not normalise the stream
        norm: layers
        for norm, layers in find_pairs(model, [first], views=True).items()
        if getattr(named[norm], "weight", None) is None or named[norm].weight.shape[-1] == width
    }
    readers = {layer: norm for norm, layers in pairs.items() for layer in layers}
    for norm in pairs:
        _check_norm(norm, named[norm])
    blocks = find_blocks(model, at_least=1)  # a one-layer decoder's stream has writers too
    writers = [
        name
        for name, m in named.items()
        if isinstance(m, nn.Linear) and m.out_features == width and name not in readers
        and any(name.startswith(b + ".") for b in blocks)
    ]  # fmt: skip
    _check_untied(model, readers, embeddings)
    return _RotationSites(width, pairs, readers, writers, embeddings, first)


@dataclass(frozen=True)
class RotateSpec:
    """How to rotate (see :func:`rotate`): the random signs' ``seed``, ``online`` (``down_proj``'s
    inputs rotated by a hook too) and ``learn`` (None, True, a dict of
    :class:`~surgery.LearnSpec`'s fields or one: the rotation trained, SpinQuant's R1 and R2)."""

    seed: int = 0
    online: bool = True
    learn: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigTypeError("rotate.seed", self.seed, "must be an integer")
        if not isinstance(self.online, bool):
            raise ConfigTypeError("rotate.online", self.online, "must be true or false")
        object.__setattr__(self, "learn", LearnSpec.of(self.learn))


@verb(
    "rotate",
    RotateSpec,
    calibration="required",
    offloaded=lambda source, spec, call: _rotate_offloaded_spec(source, spec, call),
    experts=with_linear_experts,
    expert_statistics=False,
)
def rotate(model: nn.Module, spec: RotateSpec, call: VerbCall) -> RotateHandle | OffloadedCompression:
    """Rotate the residual stream of ``model`` (see the module docstring); return a handle whose
    ``restore()`` gives back every original value and removes the hooks.

    Args:
        model: a residual-stream model with RMSNorm (Llama, Mistral, Qwen2 built by transformers);
            or an offloaded model's handle (:func:`surgery.offloaded`), rotated stage by stage
            into ``work`` (with ``online=False``: no file holds the online hook).
        calibration: batches; the first traces which layers read the stream and checks the
            rotated model's outputs; a learned rotation trains on all of them.
        spec: a :class:`RotateSpec` holding the settings below (the keywords are a shorthand for it).
        seed: of the random signs.
        online: also rotate the inputs of layers writing to the stream from another width
            (``down_proj``) with a hook; such a handle cannot be baked.
        learn: None or False: the random Hadamard rotation; True, a dict of settings or a
            :class:`~surgery.ops.equivalence.learned_rotation.LearnSpec`: start from it and train
            it through the quantized forward with Cayley SGD (SpinQuant's R1, and with ``heads``
            each attention's per-head value rotation, R2), then fuse them alike.
        work, progress: for an offloaded model, the folder its rotated stages are written to
            (default a temporary one) and the progress bar (also of the learning steps).
    """
    return _rotate_in_memory(model, call.calibration, spec.seed, spec.online, spec.learn, call.progress)


def _rotate_offloaded_spec(source: Offloaded, spec: RotateSpec, call: VerbCall) -> OffloadedCompression:
    """:func:`rotate` on an offloaded model: the random rotation only, stage by stage."""
    if spec.learn is not None:
        raise ConfigError(
            "rotate.learn", "set", "trains through the whole model's forward; an offloaded model is not in memory"
        )
    return _rotate_offloaded(source, call.calibration, spec.seed, spec.online, call.work, call.progress)


def _rotate_in_memory(
    model: nn.Module, calibration: Inputs, seed: int, online: bool, spec: LearnSpec | None, progress: bool
) -> RotateHandle:
    """:func:`rotate` on a model in memory (its fused experts already per-expert layers)."""
    sites = _find_sites(model, calibration, online)
    named = dict(model.named_modules())
    handle = RotateHandle(model)
    handle.width, handle.embeddings = sites.width, sites.embeddings
    handle.readers, handle.writers = sorted(sites.readers), sites.writers
    inner = {
        name: hadamard(named[name].in_features, seed + 1)
        for name in sites.writers
        if online and named[name].in_features != sites.width
    }
    heads = find_heads(named, find_blocks(model, at_least=1)) if spec is not None and spec.heads else {}
    heads = {name: h for name, h in heads.items() if h.output not in inner}  # an online o_proj: its hook's order
    rotations = {STREAM: hadamard(sites.width, seed)}
    rotations |= {name: hadamard(h.width, seed + 2 + i) for i, (name, h) in enumerate(heads.items())}
    params = dict(model.named_parameters())
    base = {n: guards.current_value(p).detach() for n, p in params.items()}
    values = _all_values(named, sites, rotations, inner, heads, base)
    guards.check_editable({n: params[n] for n in values}, "rotate")
    reference = _finite_reference(_outputs(model, sites.first))
    if spec is not None:
        calls = _all_calls(calibration, sites.first)
        values_of = lambda r: _all_values(named, sites, r, inner, heads, base)  # noqa: E731
        rotations = _learned(model, named, rotations, values_of, inner, calls, spec, progress)
        values = _all_values(named, sites, rotations, inner, heads, base)
    handle.rotation = rotations.pop(STREAM)
    handle.head_rotations = rotations
    with handle.applying():
        attach_all(handle, model, {n: (params[n], Rotated(v)) for n, v in values.items()}, "rotate hook")
        for name, h in inner.items():
            handle.add_hook(f"online Hadamard before {name}", named[name].register_forward_pre_hook(_rotating(h)))
            handle.online.append(name)
        _check_same_function(model, sites.first, reference)
    return handle


def _stream_values(
    named: dict[str, nn.Module], sites: _RotationSites, q: Tensor, inner: dict[str, Tensor]
) -> dict[str, Tensor]:
    """Every changed parameter's value for the stream rotation ``q`` (differentiable in ``q``),
    the online Hadamards ``inner`` folded into their layers' weights."""
    values = _rotated_values(named, sites.pairs, sites.readers, sites.writers, sites.embeddings, q, _gains(named))
    for name, h in inner.items():
        values[f"{name}.weight"] = values[f"{name}.weight"] @ h.to(values[f"{name}.weight"])
    return values


def _all_calls(calibration: Inputs, first: Any) -> list[Any]:
    """Every calibration batch as a call (the first one again, when ``calibration`` is an
    iterator the trace already drew it from)."""
    if isinstance(calibration, Iterator):
        return [first, *batches(calibration, "rotate.calibration")]
    return list(batches(calibration, "rotate.calibration"))


def _all_values(
    named: dict[str, nn.Module],
    sites: _RotationSites,
    rotations: dict[str, Tensor],
    inner: dict[str, Tensor],
    heads: dict[str, Heads],
    base: dict[str, Tensor],
) -> dict[str, Tensor]:
    """The stream rotation ``rotations[STREAM]``'s values, then each attention's per-head one."""
    values = _stream_values(named, sites, rotations[STREAM], inner)
    for name, found in heads.items():
        rotate_heads(values, base, found, rotations[name])
    return values


def _learned(
    model: nn.Module,
    named: dict[str, nn.Module],
    starts: dict[str, Tensor],
    values_of: Callable[[dict[str, Tensor]], dict[str, Tensor]],
    inner: dict[str, Tensor],
    calls: list[Any],
    spec: LearnSpec,
    progress: bool,
) -> dict[str, Tensor]:
    """``starts`` trained through the quantized forward: every Linear of the blocks quantized,
    the online Hadamards ``inner`` rotating their layers' inputs first, as attached later."""
    blocks = find_blocks(model, at_least=1)
    layers = {
        name: m
        for name, m in named.items()
        if isinstance(m, nn.Linear) and any(name.startswith(b + ".") for b in blocks)
    }
    return learn_rotation(
        model,
        starts,
        values_of,
        layers,
        calls,
        spec,
        online={name: _rotating(h) for name, h in inner.items()},
        progress=progress,
    )


def _rotate_offloaded(
    source: Offloaded, calibration: Inputs, seed: int, online: Any, work: Any, progress: bool
) -> OffloadedCompression:
    """Each stage's weights rotated from the source files and written to ``work``; a reader
    whose norm is in another stage (the head) takes that norm's gain from the source files."""
    if online is True:
        raise ConfigError(
            "rotate.online",
            True,
            "an offloaded model is rotated into its files, and no file holds the online Hadamard "
            "before down_proj; rotate it with online=False",
        )
    model = source.model
    calls = materialise(calibration, "rotate.calibration", model, (seed, online))
    with evaluating(model), torch.no_grad():
        sites = _find_sites(model, calls, online)
        reference = _finite_reference(_outputs(model, sites.first))
    named = dict(model.named_modules())
    changed = {*sites.embeddings, *sites.pairs, *sites.readers, *sites.writers}
    layers = {name: module for name, module in named.items() if name in changed}
    q = hadamard(sites.width, seed)

    def original_gain(norm: str) -> Tensor:
        with source.reading_source(), source.resident(named[norm]) as weights:
            return weights[f"{norm}.weight"].detach().clone()

    def run(skeleton: nn.Module, staged: list[str], block: str | None, calls: Any) -> RotateHandle:
        here = dict(skeleton.named_modules())
        inside = {name for name in staged}
        pairs = {norm: layers for norm, layers in sites.pairs.items() if norm in inside}
        readers = {layer: norm for layer, norm in sites.readers.items() if layer in inside}
        writers = [name for name in sites.writers if name in inside]
        embeddings = [name for name in sites.embeddings if name in inside]
        local = _gains(here)
        values = _rotated_values(
            here, pairs, readers, writers, embeddings, q, lambda n: local(n) if n in here else original_gain(n)
        )
        params = dict(skeleton.named_parameters())
        handle = RotateHandle(skeleton)
        attach_all(handle, skeleton, {n: (params[n], Rotated(v)) for n, v in values.items()}, "rotate hook")
        return handle

    verb = OffloadedVerb("rotate", run, f"seed={seed}", sequential=False)
    handle = compress_offloaded(source, verb, layers, None, blocks=find_blocks(model), work=work, progress=progress)
    with handle.applying():
        _check_same_function(model, sites.first, reference)
    return handle


def _gains(named: dict[str, nn.Module]) -> Callable[[str], Tensor]:
    return lambda norm: guards.current_value(named[norm].weight).detach()


def _stream(model: nn.Module, named: dict[str, nn.Module]) -> tuple[int, list[str]]:
    """The residual stream's width and the embeddings writing it."""
    embeddings = [name for name, m in named.items() if isinstance(m, nn.Embedding)]
    get = getattr(model, "get_input_embeddings", None)
    token = get() if callable(get) else None
    width = token.embedding_dim if isinstance(token, nn.Embedding) else None
    if width is None and embeddings:
        width = named[embeddings[0]].embedding_dim
    if width is None:
        raise ConfigError("rotate", type(model).__name__, "has no embedding writing a residual stream to rotate")
    return width, [name for name in embeddings if named[name].embedding_dim == width]


def _check_untied(model: nn.Module, readers: dict[str, str], embeddings: list[str]) -> None:
    """A head sharing its weight with the embeddings would need two rotations of one tensor."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name.rpartition(".")[0])
    for shared in names.values():
        if len(shared) > 1 and any(n in readers for n in shared) and any(n in embeddings for n in shared):
            raise ConfigError(
                "rotate",
                next(n for n in shared if n in readers),
                "shares its weight with the embeddings (tied): the head reads the stream after a norm "
                "and the embeddings write it, so one tensor would need two rotations; untie them first",
            )


def _check_norm(name: str, module: nn.Module) -> None:
    if not type(module).__name__.endswith("RMSNorm"):
        raise ConfigError(
            "rotate",
            name,
            f"is a {type(module).__name__}, which subtracts the mean (a rotation does not commute with "
            "it); only RMSNorm models rotate",
        )
    if getattr(module, "bias", None) is not None:
        raise ConfigError("rotate", name, "has a bias, which a rotation cannot fold")
    _check_gain(name, module)


def _check_gain(name: str, module: nn.Module) -> None:
    """A norm must scale by its ``weight``, which the rotation folds into the next layers and
    sets to ones; Gemma's scale by ``1 + weight`` (a probe on random rows tells them apart)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor) or weight.is_meta or weight.dim() != 1 or not torch.isfinite(weight).all():
        return
    x = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight)
    with torch.no_grad():
        found = module(x).double()
    unit = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True))
    tolerance = 1e-2 if weight.dtype != torch.float32 else 1e-4
    if torch.allclose(found, unit * weight.double(), rtol=tolerance, atol=tolerance):
        return
    if torch.allclose(found, unit * (1 + weight.double()), rtol=tolerance, atol=tolerance):
        how = "scales by (1 + weight) (as Gemma's norms do)"
    else:
        how = "does not scale its normalised input by its weight"
    raise ConfigError(
        "rotate",
        name,
        f"is a {type(module).__name__} that {how}; a rotation folds a norm's weight into the next "
        "layers and sets it to ones, which this norm would not compute",
    )


def _finite_reference(outputs: Tensor) -> Tensor:
    """The model's outputs before rotating, refused when they hold NaN or Inf (then nothing
    would tell a rotation that changed the function)."""
    if not torch.isfinite(outputs).all():
        raise ConfigError(
            "rotate.calibration",
            "batch 0",
            "the model's outputs on it hold NaN or Inf before rotating; rotate a model whose outputs are finite",
        )
    return outputs


def _rotated_values(
    named: dict[str, nn.Module],
    pairs: dict[str, list[str]],
    readers: dict[str, str],
    writers: list[str],
    embeddings: list[str],
    q: Tensor,
    gain: Callable[[str], Tensor],
) -> dict[str, Tensor]:
    """Every changed parameter's new value (float64 products, cast back); ``gain(norm)`` is a
    norm's weight as it was."""
    values: dict[str, Tensor] = {}
    placed: dict[torch.device, Tensor] = {}  # the rotation copied once to each device the weights are on

    def q64(device: torch.device) -> Tensor:
        if device not in placed:
            placed[device] = q.double().to(device)
        return placed[device]

    def put(name: str, value: Tensor, like: Tensor) -> None:
        values[name] = value.to(like.dtype)

    for name in embeddings:
        weight = guards.current_value(named[name].weight).detach()
        put(f"{name}.weight", weight.double() @ q64(weight.device), weight)
    for norm in pairs:
        weight = guards.current_value(named[norm].weight).detach()
        put(f"{norm}.weight", torch.ones_like(weight, dtype=torch.float64), weight)
    for layer, norm in readers.items():
        weight = guards.current_value(named[layer].weight).detach()
        put(f"{layer}.weight", (weight.double() * gain(norm).to(weight.device).double()) @ q64(weight.device), weight)
    for layer in writers:
        module = named[layer]
        weight = guards.current_value(module.weight).detach()
        put(f"{layer}.weight", q64(weight.device).t() @ weight.double(), weight)
        if module.bias is not None:
            bias = guards.current_value(module.bias).detach()
            put(f"{layer}.bias", bias.double() @ q64(bias.device), bias)
    return values


def _rotating(h: Tensor) -> Callable:
    cast: dict[tuple, Tensor] = {}  # h in each input's dtype and device, made once (not a copy a forward)

    def hook(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        key = (x.dtype, x.device)
        if key not in cast:
            cast[key] = h.to(x.dtype).to(x.device)
        return (x @ cast[key], *args[1:])

    return hook


def _outputs(model: nn.Module, call: Any) -> Tensor:
    with evaluating(model), torch.no_grad():
        out = call(model)
    out = getattr(out, "logits", out)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.detach().float()


def _check_same_function(model: nn.Module, call: Any, reference: Tensor) -> None:
    rotated = _outputs(model, call)
    error = ((rotated - reference).abs().max() / reference.abs().max().clamp(min=1e-12)).item()
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    # rounding the rotated weights to their dtype moves outputs by ~1e-6 of their range in float32
    # and ~1e-2 in bfloat16; a layer the rotation misses moves them by their own size
    if not error < max(1e-3, 4 * torch.finfo(dtype).eps):
        raise ConfigError(
            "rotate",
            type(model).__name__,
            f"the rotated model computes another function (its outputs moved by {error:.2g} of their "
            "largest value): a layer reads or writes the residual stream in a way this rotation does not cover",
        )
