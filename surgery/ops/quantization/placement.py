"""``quantize(..., where="tensors")``: each activation tensor quantized once, by the module that
writes it, as graph runtimes quantize (ONNX Runtime's QDQ fusion): a layer's output, or the ReLU
after it (the ReLU folds into the quantizer, whose zero point clamps at 0); a layer's input only
where no quantized module wrote it. One forward finds who writes what."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from surgery.core._compat import tensor_stamp
from surgery.core.errors import ConfigError
from surgery.core.inputs import Call

ACTIVATIONS = (nn.ReLU,)  # each call quantized at its output: a runtime fuses it into that quantizer
SAME_VALUES = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)  # no op in an exported graph
KEEPS_GRID = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.Flatten)  # values on a grid stay on it
OUTPUT_KEY = "@output"  # the key of a layer's output quantizer is "<layer>@output"


@dataclass(frozen=True)
class Site:
    """One activation quantizer: the ``side`` of ``layer`` at its ``call``-th run in a forward
    of ``runs`` (a ReLU gets one per call it is quantized at); ``follows``: the key of the
    quantizer whose grid it takes (a layer reading a max-pooled quantized tensor)."""

    layer: str
    side: str
    call: int = 0
    runs: int = 1
    follows: str | None = None

    @property
    def key(self) -> str:
        return site_key(self.layer, self.side, self.call)


def saved_sites(saved: dict[str, Tensor], modules: set[str]) -> list[Site]:
    """The sites a ``where="tensors"`` handle's :meth:`qparams` hold: ``"<key>.scale"`` of each
    quantizer of a module of ``modules``, ``"<key>.runs"`` for those quantized per call."""
    sites = []
    for name in saved:
        key = name.removesuffix(".scale")
        if key == name:
            continue
        base, _, call = key.partition("#")
        layer = base.removesuffix(OUTPUT_KEY)
        if layer in modules:
            runs = saved.get(f"{key}.runs")
            side = "input" if layer == base else "output"
            sites.append(Site(layer, side, int(call or 0), 1 if runs is None else int(runs)))
    return sites


def site_key(layer: str, side: str, call: int = 0) -> str:
    """``"<layer>"`` (input), ``"<layer>@output"``, and ``"#k"`` after it for the k-th call."""
    base = f"{layer}{OUTPUT_KEY}" if side == "output" else layer
    return f"{base}#{call}" if call else base


@dataclass(frozen=True)
class _Origin:
    layer: str
    call: int
    direct: bool  # no graph op between the writer and the reader (only identities)


def tensor_sites(model: nn.Module, layers: dict[str, nn.Module], call: Call) -> list[Site]:
    """The quantizers of ``where="tensors"`` for the selected ``layers``, found by running ``call``
    once in eval mode. Autograd's record links a layer to one reading it through a functional
    ``relu``, which then has no output quantizer of its own: the reader's input quantizer is the
    one after the ReLU."""
    layers = {n: m for n, m in layers.items() if not isinstance(m, ACTIVATIONS)}  # a selected ReLU: per call
    names = {id(m): n for n, m in model.named_modules()}
    origin: dict[int, tuple[_Origin, tuple[int, int]]] = {}  # id -> (writer, stamp when written)
    keep: list[Tensor] = []  # alive until the forward ends, so ids stay unique
    runs: Counter = Counter()
    reads: dict[tuple[str, int], _Origin | None] = {}  # (layer or ReLU, call) -> where its input came from
    graph_writers: dict[object, tuple[str, int]] = {}  # a layer output's autograd node -> (layer, call)
    through_relu: set[tuple[str, int]] = set()  # (layer, call) whose output a functional relu passes on

    def writer(args: tuple) -> _Origin | None:
        """Who wrote the first input, unless it was changed in place since (``out += identity``)."""
        found = origin.get(id(args[0])) if args and isinstance(args[0], Tensor) else None
        return found[0] if found is not None and found[1] == tensor_stamp(args[0]) else None

    def wrote(output: object, source: _Origin) -> None:
        if isinstance(output, Tensor):
            origin[id(output)] = (source, tensor_stamp(output))
            keep.append(output)

    def before(module: nn.Module, args: tuple) -> None:
        name = names[id(module)]
        reads[(name, runs[name])] = source = writer(args)
        node = args[0].grad_fn if source is None and args and isinstance(args[0], Tensor) else None
        if node is not None and node.name() == "ReluBackward0" and name in layers:
            found = graph_writers.get(node.next_functions[0][0])
            if found is not None:
                through_relu.add(found)

    def after(module: nn.Module, args: tuple, output: object) -> None:
        name = names[id(module)]
        wrote(output, _Origin(name, runs[name], True))
        if isinstance(output, Tensor) and output.grad_fn is not None and name in layers:
            graph_writers[output.grad_fn] = (name, runs[name])
        runs[name] += 1

    def passes(module: nn.Module, args: tuple, output: object) -> None:
        source = writer(args)
        if source is not None:
            wrote(output, _Origin(source.layer, source.call, source.direct and isinstance(module, SAME_VALUES)))

    hooks = []
    relus = {n: m for n, m in model.named_modules() if isinstance(m, ACTIVATIONS) and n not in layers}
    for module in [*layers.values(), *relus.values()]:
        hooks += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    for module in model.modules():
        if isinstance(module, SAME_VALUES + KEEPS_GRID) and names[id(module)] not in layers:
            hooks.append(module.register_forward_hook(passes))
    try:
        with _probing(model, layers):
            call(model)
    finally:
        for hook in hooks:
            hook.remove()
    return _sites(layers, relus, runs, reads, through_relu)


@contextlib.contextmanager
def _probing(model: nn.Module, layers: dict[str, nn.Module]) -> Iterator[None]:
    """Eval mode with autograd recording (frozen layer weights set to require gradients, so that
    a layer's output, and a functional relu after it, are recorded), all put back after."""
    training = model.training
    frozen = [p for m in layers.values() for p in m.parameters(recurse=False) if p.is_leaf and not p.requires_grad]
    try:
        model.eval()
        for param in frozen:
            param.requires_grad_(True)
        with torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        model.train(training)
        for param in frozen:
            param.requires_grad_(False)


def _sites(layers: dict, relus: dict, runs: Counter, reads: dict, through_relu: set) -> list[Site]:
    def from_layer(source: _Origin | None) -> bool:
        return source is not None and source.layer in layers and source.direct

    fed = {(o.layer, o.call) for (r, _), o in reads.items() if r in relus and from_layer(o)} | through_relu
    feeding = {(o.layer, o.call) for (n, _), o in reads.items() if n in layers and o and o.layer in relus}
    relu_calls = [(r, k) for r in relus for k in range(runs[r]) if from_layer(reads[(r, k)]) or (r, k) in feeding]
    sites: list[Site] = []
    written: set[tuple[str, int]] = set(relu_calls)  # (module, call) whose output is on a grid
    for name in layers:
        calls = range(runs[name])
        if not calls or not all((name, c) in fed for c in calls):
            sites.append(Site(name, "output"))
            written.update((name, c) for c in calls)
    sites += [Site(relu, "output", call, runs[relu]) for relu, call in relu_calls]
    for name in layers:
        sources = [reads.get((name, c)) for c in range(runs[name])]
        quantized = [s is not None and (s.layer, s.call) in written for s in sources]
        direct = [q and s.direct for q, s in zip(quantized, sources)]
        if (any(direct) and not all(direct)) or (any(quantized) and not all(quantized)):
            raise ConfigError(
                "quantize.where",
                "tensors",
                f"{name} reads a quantized tensor as it is on some calls and not on others, so one input quantizer "
                "cannot round each tensor once; exclude it",
            )
        known = bool(sources) and all(quantized)
        if known and all(direct):
            continue  # it reads what a quantizer wrote
        first = sources[0] if known and len({(s.layer, s.call) for s in sources}) == 1 else None
        follows = None if first is None else site_key(first.layer, "output", first.call if first.layer in relus else 0)
        sites.append(Site(name, "input", follows=follows))
    return sites
