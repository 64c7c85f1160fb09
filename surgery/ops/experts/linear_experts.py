"""A fused experts module as one small MLP of ``nn.Linear`` layers per expert, computing bit for bit
what the fused module computes, and back.

``LinearExperts`` replaces, say, ``model.layers.0.mlp.experts`` (a ``Qwen3MoeExperts`` holding
``gate_up_proj (E, 2I, H)``) by ``experts.0.gate_proj``, ``experts.0.up_proj``,
``experts.0.down_proj``, ... — the names Qwen, OLMoE and DeepSeek checkpoints use. Each expert's
layers see exactly the tokens routed to it, so every method that works on a Linear (masks, grids,
GPTQ's Hessian, Wanda's norms) works on each expert with its own statistics. :func:`fold_back`
writes the layers' weights into the fused parameters again.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from surgery.core.routing import routing
from surgery.ops.experts.layouts import FusedLayout


class _Gating:
    """The fused module's own activation (its ``_apply_gate`` or ``act_fn``), held without its
    weights: the layers of each expert feed it the tensor the fused module would have."""

    def __init__(self, fused: nn.Module, layout: FusedLayout) -> None:
        shell = copy.copy(fused)
        shell.__dict__["_parameters"] = {}
        shell.__dict__["_buffers"] = {}
        self.shell = shell
        self.layout = layout

    def __call__(self, gate: Tensor | None, up: Tensor) -> Tensor:
        if not self.layout.gated:
            return self.shell.act_fn(up)
        if self.layout.concatenated:
            joined = torch.cat([gate, up], dim=-1)
        else:
            joined = torch.stack([gate, up], dim=-1).flatten(-2)
        return self.shell._apply_gate(joined)

    @property
    def grouped(self) -> bool:
        """Whether the model sums each token's experts as transformers' batched kernels do
        (``grouped_mm``, its default) rather than adding them in expert order (``eager``)."""
        config = getattr(self.shell, "config", None)
        return getattr(config, "_experts_implementation", "eager") not in (None, "eager")


class BiasAfterLinear(nn.Linear):
    """A Linear that adds its bias after the product, as transformers' fused experts do
    (``x @ W`` then ``+ b``; ``nn.Linear`` adds it inside the product, which rounds otherwise in
    half precision)."""

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight)
        return out.add_(self.bias) if self.bias is not None else out


class ExpertMLP(nn.Module):
    """One expert: ``gate_proj`` and ``up_proj`` (``up_proj`` alone when ungated), then ``down_proj``."""

    def __init__(self, gate: nn.Linear | None, up: nn.Linear, down: nn.Linear, gating: _Gating) -> None:
        super().__init__()
        self.gated = gate is not None
        if gate is not None:
            self.gate_proj = gate
        self.up_proj = up
        self.down_proj = down
        self.__dict__["_gating"] = gating

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj(x) if self.gated else None
        return self.down_proj(self._gating(gate, self.up_proj(x)))


class LinearExperts(nn.ModuleList):
    """The experts of one mixture-of-experts layer as a list of :class:`ExpertMLP`, called like the
    fused module it replaces: ``(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k))``.

    Example:
        >>> experts = LinearExperts.from_fused(mlp.experts, fused_layout(mlp.experts))
        >>> torch.equal(experts(h, index, weights), mlp.experts(h, index, weights))
        True
    """

    def __init__(self, experts: list[ExpertMLP], layout: FusedLayout, gating: _Gating) -> None:
        super().__init__(experts)
        self.layout = layout
        self.__dict__["_gating"] = gating
        self.register_state_dict_post_hook(_fused_state)  # saved while attached: the model's own keys
        self.register_load_state_dict_pre_hook(_split_state)
        self.fused_shapes: dict[str, torch.Size] = {}  # the fused parameters' shapes, by name
        self.routed = [0] * len(experts)  # tokens the router sent to each expert so far
        self.seen = [0] * len(experts)  # tokens each expert ran on so far (all of them, calibrating every expert)

    @classmethod
    def from_fused(cls, fused: nn.Module, layout: FusedLayout) -> LinearExperts:
        """Copy each expert of ``fused`` into its own layers (the fused module is left as it was)."""
        gating = _Gating(fused, layout)
        names = [layout.up_name, "down_proj"] + ([f"{layout.up_name}_bias", "down_proj_bias"] if layout.bias else [])
        tensors = {name: getattr(fused, name) for name in names}
        parts = split_tensors(layout, tensors)
        grad = {name: tensors[name].requires_grad for name in names}

        def layer(e: int, name: str, source: str) -> nn.Linear:
            return _linear(parts[f"{e}.{name}.weight"], parts.get(f"{e}.{name}.bias"), grad[source])

        experts = [
            ExpertMLP(
                layer(e, "gate_proj", layout.up_name) if layout.gated else None,
                layer(e, "up_proj", layout.up_name),
                layer(e, "down_proj", "down_proj"),
                gating,
            )
            for e in range(layout.num_experts)
        ]
        linear = cls(experts, layout, gating)
        linear.fused_shapes = {name: tensors[name].shape for name in names}
        return linear

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        count = len(self)
        with torch.no_grad():
            routed = F.one_hot(top_k_index, num_classes=count + 1).permute(2, 1, 0)
            hit = torch.greater(routed.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
        grouped = self._gating.grouped
        mode = routing()
        every = mode != "routed"
        if grouped and not every:
            return self._as_grouped_kernel(hidden_states, top_k_index, top_k_weights)
        dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
        if grouped:
            out = hidden_states.new_zeros((*top_k_index.shape, hidden_states.shape[-1]), dtype=dtype)
        else:
            out = torch.zeros_like(hidden_states)
        for e in range(count) if every else hit:
            if e == count:
                continue
            position, token = torch.where(routed[e])
            if mode != "trace":
                self.routed[e] += int(token.numel())
                self.seen[e] += int(hidden_states.shape[0] if every else token.numel())
            if every:
                y = self[e](hidden_states)[token]  # statistics from every token; the routed rows go on
            else:
                y = self[e](hidden_states[token])
            if token.numel() == 0:
                continue
            y = y * top_k_weights[token, position, None]
            if grouped:
                out[token, position] = y.to(out.dtype)
            else:
                out.index_add_(0, token, y.to(out.dtype))
        return out.sum(dim=1).to(hidden_states.dtype) if grouped else out

    def _as_grouped_kernel(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """The routed forward as transformers' grouped kernel computes it: the (token, choice) rows
        sorted by expert, each expert's layers on its run of rows, the gate applied once over all
        rows (an elementwise kernel rounds by where a row sits in the tensor), then each row
        weighted, put back in token order and the choices summed."""
        k = top_k_index.shape[-1]
        with torch.no_grad():
            experts, order = torch.sort(top_k_index.reshape(-1))
            ends = torch.bincount(experts, minlength=len(self) + 1).cumsum(0).tolist()
        rows = hidden_states[torch.div(order, k, rounding_mode="floor")]
        spans = [(e, ends[e - 1] if e else 0, ends[e]) for e in range(len(self))]
        spans = [(e, start, end) for e, start, end in spans if end > start]
        gates, ups = [], []
        for e, start, end in spans:
            self.routed[e] += end - start
            self.seen[e] += end - start
            gates.append(self[e].gate_proj(rows[start:end]) if self[e].gated else None)
            ups.append(self[e].up_proj(rows[start:end]))
        if not spans:
            return torch.zeros_like(hidden_states)
        gate = torch.cat(gates) if self.layout.gated else None
        active = self._gating(gate, torch.cat(ups))
        down = torch.cat([self[e].down_proj(active[start:end]) for e, start, end in spans])
        weighted = down * top_k_weights.reshape(-1)[order][: down.shape[0], None]
        out = weighted.new_zeros((order.numel(), weighted.shape[-1]))
        out[order[: down.shape[0]]] = weighted
        return out.view(*top_k_index.shape, -1).sum(dim=1).to(hidden_states.dtype)

    @property
    def selection_aliases(self) -> dict[str, list[str]]:
        """The fused parameters' names, each standing for the per-expert layers (or, for a bias,
        their bias parameters) that hold it now (``experts.down_proj`` takes every
        ``experts.N.down_proj``; ``experts.down_proj_bias`` every ``experts.N.down_proj.bias``)."""
        up = ["gate_proj", "up_proj"] if self.layout.gated else ["up_proj"]
        names = {self.layout.up_name: up, "down_proj": ["down_proj"]}
        if self.layout.bias:  # a bias names the layers' bias parameters, not the layers
            names.update(
                {f"{self.layout.up_name}_bias": [f"{n}.bias" for n in up], "down_proj_bias": ["down_proj.bias"]}
            )
        return {
            alias: [f"{e}.{layer}" for e in range(len(self)) for layer in layers] for alias, layers in names.items()
        }

    def fused_tensors(self, value: Callable[[str, Tensor], Tensor] | None = None) -> dict[str, Tensor]:
        """The fused parameters these layers hold now, by the fused module's parameter names; with
        ``value``, each layer's parameter is ``value(name, parameter)`` instead (``name`` as
        ``"3.gate_proj.weight"``), a tensor of its shape (to trace where each lands)."""
        layout = self.layout
        get = value or (lambda name, tensor: tensor)
        ups, downs, up_biases, down_biases = [], [], [], []
        for e, expert in enumerate(self):

            def of(layer: str, kind: str, expert: ExpertMLP = expert, e: int = e) -> Tensor:
                return get(f"{e}.{layer}.{kind}", getattr(getattr(expert, layer), kind))

            up = of("up_proj", "weight")
            ups.append(_stored(layout, _joined(layout, of("gate_proj", "weight"), up) if layout.gated else up))
            downs.append(_stored(layout, of("down_proj", "weight")))
            if layout.bias:
                up_bias = of("up_proj", "bias")
                up_biases.append(_joined(layout, of("gate_proj", "bias"), up_bias) if layout.gated else up_bias)
                down_biases.append(of("down_proj", "bias"))
        tensors = {layout.up_name: torch.stack(ups), "down_proj": torch.stack(downs)}
        if layout.bias:
            tensors[f"{layout.up_name}_bias"] = torch.stack(up_biases)
            tensors["down_proj_bias"] = torch.stack(down_biases)
        return tensors


def _linear(weight: Tensor, bias: Tensor | None, requires_grad: bool) -> nn.Linear:
    """A Linear holding copies of ``weight`` (out, in) and ``bias``, built without initialising."""
    kind = nn.Linear if bias is None else BiasAfterLinear
    layer = kind(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.detach().clone(memory_format=torch.contiguous_format), requires_grad)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone(), requires_grad)
    return layer


def _joined(layout: FusedLayout, gate: Tensor, up: Tensor) -> Tensor:
    """Gate and up rows (or biases) in the order the fused parameter keeps them."""
    if layout.concatenated:
        return torch.cat([gate, up], dim=0)
    return torch.stack([gate, up], dim=1).flatten(0, 1)


def _stored(layout: FusedLayout, matrix: Tensor) -> Tensor:
    """An ``(out, in)`` matrix in the fused parameter's axis order."""
    return matrix.detach().transpose(0, 1) if layout.transposed else matrix.detach()


def split_tensors(layout: FusedLayout, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Fused parameters by name (``gate_up_proj``, ...) as each expert's layers hold them
    (``"3.gate_proj.weight"``, ...): the inverse of :meth:`LinearExperts.fused_tensors`."""
    found: dict[str, Tensor] = {}
    up_name = layout.up_name
    for e in range(layout.num_experts):
        rows = layout.matrix(tensors[up_name], e)
        names = ["gate_proj", "up_proj"] if layout.gated else ["up_proj"]
        parts = layout.halves(rows) if layout.gated else (rows,)
        found.update({f"{e}.{n}.weight": part for n, part in zip(names, parts, strict=True)})
        found[f"{e}.down_proj.weight"] = layout.matrix(tensors["down_proj"], e)
        if layout.bias:
            bias = tensors[f"{up_name}_bias"][e]
            found.update(
                {
                    f"{e}.{n}.bias": part
                    for n, part in zip(names, layout.halves(bias) if layout.gated else (bias,), strict=True)
                }
            )
            found[f"{e}.down_proj.bias"] = tensors["down_proj_bias"][e]
    return found


def _fused_state(module: LinearExperts, state: dict[str, Tensor], prefix: str, local_metadata: dict) -> None:
    """``state_dict()`` hook: the per-expert entries replaced by the fused parameters they make now."""
    for key in [k for k in state if k.startswith(prefix) and k[len(prefix) :].split(".")[0].isdigit()]:
        del state[key]
    for name, value in module.fused_tensors().items():
        state[f"{prefix}{name}"] = value.clone()


def _split_state(module: LinearExperts, state: dict, prefix: str, *args: object) -> None:
    """``load_state_dict()`` hook: fused parameters in ``state`` split into the per-expert entries."""
    names = list(module.fused_tensors())
    if all(f"{prefix}{name}" in state for name in names):
        tensors = {name: state.pop(f"{prefix}{name}") for name in names}
        state.update({f"{prefix}{key}": value for key, value in split_tensors(module.layout, tensors).items()})
