"""``format="onnx"``: a QDQ model placed so that ONNX Runtime forms int8 kernels (QLinearConv,
QGemm, MatMulIntegerToFloat): each quantized weight becomes int8 integers with a
DequantizeLinear, each quantized activation a QuantizeLinear/DequantizeLinear pair with surgery's
own scale, and biases int32 at scale (input scale × weight scale)."""

from __future__ import annotations

import ast
import copy
import inspect
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from surgery.core._compat import drop_forward_hooks
from surgery.core.errors import ConfigError
from surgery.core.inputs import Call
from surgery.core.layer_kinds import is_kind
from surgery.ops.equivalence.folding import batchnorm_pairs, is_neutral
from surgery.ops.experts.routing import refuse_experts
from surgery.ops.export.format_table import ExportFormat, register_export_format
from surgery.ops.export.formats.onnx_nbits import BLOCK_SIZES, gemm_problem, matmul_nbits, nbits_problem, uses_domain
from surgery.ops.export.formats.requirements import required
from surgery.ops.numerics.deployment import ActivationGrid, ExportParts, WeightGrid
from surgery.ops.quantization.targets import DeployTarget

log = logging.getLogger("surgery")
OPTIONS = ("opset", "weights")
WEIGHT_TYPES = ("uint8", "int8")  # how int8 weights are held: see _QDQ._weight
INT8_WEIGHTS_HINT = (
    "with weights='int8' ONNX Runtime runs its u8s8 kernels, which add pairs of products in int16 on x86 "
    "CPUs without VNNI (AVX2 only), a likely cause: the default weights='uint8' is exact on every CPU"
)
OPSETS = (18, 25)  # what the exporter's version converter writes keeping the module names (onnxscript 0.7)
INT8_KERNELS = (
    "QLinearConv",
    "ConvInteger",
    "QLinearMatMul",
    "MatMulInteger",
    "MatMulIntegerToFloat",
    "QGemm",
    "MatMulNBits",  # 4-bit weights: not int8, counted with the integer kernels
)
FLOAT_KERNELS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "FusedConv", "FusedGemm", "FusedMatMul")
WEIGHT_LAYOUT = {"Conv": 0, "Gemm": 0, "MatMul": 1}  # the output-channel axis of each op's weight initializer
ACTIVATION_OPS = ("Relu",)  # quantized at their output per call (where="tensors"): a runtime fuses them into Q


FLOAT_REFUSAL = "ONNX Runtime's int8 kernels take integer weights; export it with format='compressed-tensors' (fp8_e4m3) or 'safetensors'"


def onnx_layer(module: nn.Module, name: str = "") -> bool:
    """The layers the QDQ writer quantizes, by the layer-kind table: ``nn.Linear`` (Gemm/MatMul) and
    the convolutions holding outputs on weight axis 0 (Conv1d/2d/3d); others stay float."""
    return is_kind(module, lambda kind: kind.name == "linear" or (kind.convolution and kind.output_axis == 0))


onnx_layer.__name__ = "Conv1d|Conv2d|Conv3d|Linear"


HALF = (torch.float16, torch.bfloat16)


def write_onnx(parts: ExportParts, path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Trace ``parts.model`` without surgery's hooks, then put surgery's grids into the graph."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError("export.options", unknown, f"format='onnx' takes {', '.join(OPTIONS)}")
    opset = _opset(options)
    held_as = options.get("weights", WEIGHT_TYPES[0])
    if held_as not in WEIGHT_TYPES:
        raise ConfigError("export.options.weights", held_as, f"must be {' or '.join(WEIGHT_TYPES)}")
    onnx = required("onnx", "onnx")
    onnxscript = required("onnxscript", "onnxscript")
    if not parts.inputs:
        raise ConfigError("export.inputs", None, "format='onnx' traces the model: pass inputs= (an example batch)")
    _check_grids(parts)
    refuse_experts(parts.model, "onnx", "data-dependent routing does not trace")
    _refuse_half(parts)
    plain = copy.deepcopy(parts.model).eval()
    if getattr(getattr(plain, "config", None), "use_cache", False):  # a decoder's cache object does not trace
        plain.config.use_cache = False  # the copy's: the graph gives the logits, the model's outputs stay
    drop_forward_hooks(plain)
    _refuse_unfolded(plain, parts)
    call = parts.inputs[0]
    # the exporter's optimizer would fuse a neutral BatchNorm subclass into the convolution
    # before it as a new node, losing the module name that finds the convolution's grids
    neutral = any(is_kind(m, lambda k: k.normalises == "channel") and is_neutral(m) for m in plain.modules())
    with torch.no_grad():
        program = torch.onnx.export(
            plain,
            call.args,
            kwargs=dict(call.kwargs),
            dynamo=True,
            optimize=not neutral,
            opset_version=opset,
            dynamic_shapes=_any_batch(plain, call),
            verbose=logging.getLogger("surgery").isEnabledFor(logging.DEBUG),  # its steps: hydra.verbose=surgery
        )
    if neutral:  # its constants folded still: a bias-less convolution's zero bias is Expand(Shape(weight))
        onnxscript.optimizer.fold_constants(program.model)
    program.save(str(path))
    model = onnx.load(str(path))
    _QDQ(model, parts, held_as).insert()
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    notes = {"exact": False, "int8_ops": _int8_ops_said(path, len(parts.weights))}
    return notes | ({"parity_hint": INT8_WEIGHTS_HINT} if held_as == "int8" else {})


def _refuse_half(parts: ExportParts) -> None:
    """ONNX Runtime's CPU kernels take no bfloat16, and its QuantizeLinear and MatMulNBits
    graphs as written here float32 inputs: a half-precision model is refused in one line."""
    half = sorted(str(p.dtype).removeprefix("torch.") for p in parts.model.parameters() if p.dtype in HALF)
    if half:
        raise ConfigError(
            "export.format",
            "onnx",
            f"writes float32 graphs for ONNX Runtime's CPU kernels; this model is {half[0]}: export a copy cast "
            "with .float(), or use format='gguf' or 'compressed-tensors'",
        )


def _int8_ops_said(path: Path, quantized: int) -> tuple[int, int]:
    """:func:`count_int8_ops`, with a warning when fewer than the ``quantized`` layers run in int8."""
    int8, weighted = count_int8_ops(path)
    if int8 < quantized:
        log.warning(
            "export: ONNX Runtime runs %d of the %d quantized layers on int8 kernels (%d weighted ops in all); "
            "the others compute in float",
            int8,
            quantized,
            weighted,
        )
    return int8, weighted


def _opset(options: dict[str, Any]) -> int:
    """The ``opset`` option, checked: an integer the exporter writes with the module names kept."""
    opset = options.get("opset", OPSETS[0])
    if isinstance(opset, bool) or not isinstance(opset, int) or not OPSETS[0] <= opset <= OPSETS[1]:
        raise ConfigError("export.options.opset", opset, f"must be an integer from {OPSETS[0]} to {OPSETS[1]}")
    return opset


def count_int8_ops(path: Path) -> tuple[int, int]:
    """(weighted ops ONNX Runtime runs on int8 kernels, weighted ops), read from the graph it
    optimizes ``path`` into: a weighted op is a Conv/MatMul/Gemm with a constant weight, float or
    fused into an int8 kernel (QLinearConv, QGemm, MatMulIntegerToFloat...)."""
    ort, onnx = required("onnxruntime", "onnxruntime"), required("onnx", "onnx")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED  # QDQ fusions, no layouts
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory() as folder:
        options.optimized_model_filepath = str(Path(folder) / "optimized.onnx")
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        graph = onnx.load(options.optimized_model_filepath).graph
    constant = {i.name for i in graph.initializer if len(i.dims) >= 2}
    constant |= {n.output[0] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in constant}
    weighted = [n.op_type for n in graph.node if any(i in constant for i in n.input[1:])]
    int8 = sum(kind in INT8_KERNELS for kind in weighted)
    return int8, int8 + sum(kind in FLOAT_KERNELS for kind in weighted)


def _any_batch(model: nn.Module, call: Call) -> dict[str, Any]:
    """Dim 0 of every tensor argument dynamic, by the name ``forward`` gives it: the exported
    graph then takes any batch size, as the model under surgery does."""
    bound = inspect.signature(model.forward).bind(*call.args, **call.kwargs)
    return {
        name: {0: torch.export.Dim.DYNAMIC} if isinstance(value, Tensor) and value.dim() > 0 else None
        for name, value in bound.arguments.items()
    }


def _check_grids(parts: ExportParts) -> None:
    if not parts.weights and not parts.activations:
        raise ConfigError("export.handle", "nothing quantized", "format='onnx' holds quantized weights and activations")
    for key, grid in parts.weights.items():
        if grid.spec.is_float:
            raise ConfigError(
                "quantize.weights.format",
                grid.spec.format,
                f"is a floating-point grid; {FLOAT_REFUSAL}",
            )
        int8 = grid.spec.bits == 8 and grid.spec.symmetric and not grid.group_size
        if not int8 and nbits_problem(grid) is not None:
            raise ConfigError(
                "quantize.weights",
                f"{key}: {grid.spec.bits}-bit {'symmetric' if grid.spec.symmetric else 'affine'}"
                f"{f' group {grid.group_size}' if grid.group_size else ''}",
                "ONNX Runtime's int8 kernels take 8-bit symmetric weights, per channel or per tensor, and its "
                f"MatMulNBits 4-bit weights in groups of {', '.join(map(str, BLOCK_SIZES))}",
            )
        layer = key.rpartition(".")[0]
        if not int8 and any(a == layer for a, _, _ in parts.activations):
            raise ConfigError(
                "quantize.activations",
                layer,
                "its 4-bit weights run in MatMulNBits, which takes float inputs; leave its activations float",
            )
    for (layer, where, _), grid in parts.activations.items():
        if grid.dynamic:
            raise ConfigError(
                "quantize.activations.dynamic",
                grid.spec.dynamic,
                "a QDQ graph holds static scales; calibrate them (dynamic=null), or export "
                "dynamic inputs with format='torchao' or 'compressed-tensors'",
            )
        if grid.spec.is_float or grid.spec.bits != 8 or grid.axis is not None:
            raise ConfigError(
                "quantize.activations",
                f"{layer} {where}",
                "ONNX Runtime quantizes activations with one 8-bit scale per tensor",
            )


def _refuse_unfolded(plain: nn.Module, parts: ExportParts) -> None:
    for conv, norm in batchnorm_pairs(plain, parts.inputs[0]):
        if parts.layer_weight(conv) is not None and not is_neutral(plain.get_submodule(norm)):
            raise ConfigError(
                "export.handle",
                f"{conv} feeds BatchNorm {norm}",
                "the ONNX exporter folds it and the weights leave their grid; quantize with target='onnx'",
            )


class _QDQ:
    """Surgery's grids put into a traced float graph, node by node."""

    def __init__(self, model: Any, parts: ExportParts, weights_as: str = "uint8") -> None:
        from onnx import numpy_helper

        self.model, self.parts, self.graph = model, parts, model.graph
        self.weights_as = weights_as
        self.numpy = numpy_helper
        self.initializers = {i.name: i for i in self.graph.initializer}
        self.count = 0
        self.grids: dict[str, ActivationGrid] = {}  # each DequantizeLinear output -> its grid

    def insert(self) -> None:
        layers = {layer for layer, _, _ in self.parts.activations} | {k.rpartition(".")[0] for k in self.parts.weights}
        found: set[tuple[str, int]] = set()
        runs: dict[str, int] = {}
        for node in list(self.graph.node):
            layer = self._layer(node, layers)
            if layer is not None and node.op_type in ACTIVATION_OPS:
                call = runs[layer] = runs.get(layer, -1) + 1  # the graph lists a module's runs in order
                found.add((layer, call))
                outputs = self.parts.activation(layer, "output", call)
                if outputs is not None:
                    self._activation(node.output[0], outputs)
            if layer is None or node.op_type not in WEIGHT_LAYOUT:
                continue
            found.add((layer, 0))
            inputs = self.parts.activation(layer, "input")
            weight = self.parts.layer_weight(layer)
            if weight is not None:
                self._weight(node, weight)
            if inputs is not None:  # a follower (a max-pooled quantized tensor) is on its grid for every reader
                self._activation(node.input[0], inputs, consumer=None if inputs.follows else node)
            read = self.grids.get(node.input[0])  # its own quantizer, or the one that wrote the tensor
            if read is not None and weight is not None and len(node.input) > 2 and node.input[2] in self.initializers:
                self._bias(node, read, weight)
            outputs = self.parts.activation(layer, "output")
            if outputs is not None:
                self._activation(self._written(node, layer), outputs)
        wanted = {(layer, call) for layer, _, call in self.parts.activations}
        wanted |= {(k.rpartition(".")[0], 0) for k in self.parts.weights}
        missing = sorted(wanted - found)
        if missing:
            layer, call = missing[0]
            raise ConfigError(
                "export.handle",
                f"{layer}{f' (run {call + 1})' if call else ''}",
                f"is quantized but no {', '.join([*WEIGHT_LAYOUT, *ACTIVATION_OPS])} of the traced graph computes it",
            )
        used = {name for node in self.graph.node for name in node.input}
        kept = [i for i in self.graph.initializer if i.name in used]  # the float weights now held as int8
        del self.graph.initializer[:]
        self.graph.initializer.extend(kept)
        _sort(self.graph)

    def _layer(self, node: Any, layers: set[str]) -> str | None:
        for prop in node.metadata_props:
            if prop.key == "pkg.torch.onnx.name_scopes":
                scopes = ast.literal_eval(prop.value)
                return next((s for s in reversed(scopes) if s in layers), None)
        return None

    def _written(self, node: Any, layer: str) -> str:
        """The tensor ``layer`` writes: ``node``'s output, or that of the ops of the same layer
        that alone read it in turn (a MatMul's bias Add): its output quantizer goes there."""
        tensor = node.output[0]
        while True:
            readers = [n for n in self.graph.node if tensor in n.input]
            if len(readers) != 1 or len(readers[0].output) != 1 or self._layer(readers[0], {layer}) != layer:
                return tensor
            tensor = readers[0].output[0]

    def _constant(self, base: str, value: np.ndarray) -> str:
        self.count += 1
        name = f"{base}__surgery{self.count}"
        self.graph.initializer.append(self.numpy.from_array(np.array(value, order="C"), name))  # 0-d stays 0-d
        return name

    def _weight(self, node: Any, grid: WeightGrid) -> None:
        from onnx import helper

        name = node.input[1]
        if name not in self.initializers:
            layer = grid.key.rpartition(".")[0]
            raise ConfigError(
                "export.handle",
                grid.key,
                f"is computed in the traced graph, not a constant its {node.op_type} reads, so it cannot be held "
                f"as int8; leave the layer out of the quantization: quantize.exclude=[{layer}] (exclude= in Python)",
            )
        value = torch.from_numpy(self.numpy.to_array(self.initializers[name]).copy())
        axis = WEIGHT_LAYOUT[node.op_type]
        if node.op_type == "Gemm" and not any(a.name == "transB" and a.i == 1 for a in node.attribute):
            axis = 1
        moved = value.movedim(axis, 0)  # the traced layout's outputs first, whatever the layer's own layout
        rows = grid.row_integers(moved.reshape(moved.shape[0], -1))
        if grid.spec.bits != 8:  # checked: 4-bit in groups, held by MatMulNBits
            problem = gemm_problem(node)
            if problem is not None:
                raise ConfigError("export.handle", grid.key, problem)
            matmul_nbits(node, grid, rows, self._constant)
            uses_domain(self.model)
            return
        integers = rows.reshape(moved.shape).movedim(0, axis)
        scale = grid.scale.float().reshape(-1).numpy()
        scale = scale.reshape(()) if grid.axis is None else scale
        # held as uint8 about 128 by default: the same values, and ONNX Runtime's u8u8 kernels, which
        # never saturate; its u8s8 ones (weights="int8", its own quantizer's layout) add pairs of
        # products in int16 on x86 CPUs without VNNI (AVX2) and drift there by tens of steps
        if self.weights_as == "int8":
            zero = np.zeros(scale.shape, np.int8)
            q = self._constant(f"{name}_int8", integers.numpy().astype(np.int8))
        else:
            zero = np.full(scale.shape, 128, np.uint8)
            q = self._constant(f"{name}_int8", (integers.numpy().astype(np.int16) + 128).astype(np.uint8))
        s, z = self._constant(f"{name}_scale", scale), self._constant(f"{name}_zero_point", zero)
        out = f"{name}_dequantized{self.count}"
        extra = {"axis": axis} if scale.size > 1 else {}
        self.graph.node.append(helper.make_node("DequantizeLinear", [q, s, z], [out], **extra))
        node.input[1] = out
        self._weight_scale = scale

    def _bias(self, node: Any, inputs: ActivationGrid, weight: WeightGrid) -> None:
        from onnx import helper

        name = node.input[2]
        bias = self.numpy.to_array(self.initializers[name]).astype(np.float64)
        scale = (np.float32(inputs.scale.item()) * self._weight_scale.astype(np.float32)).astype(np.float32)
        scale = np.broadcast_to(scale, bias.shape).copy()
        q = self._constant(f"{name}_int32", np.rint(bias / scale).astype(np.int32))
        s, z = (
            self._constant(f"{name}_scale", scale),
            self._constant(f"{name}_zero_point", np.zeros(scale.shape, np.int32)),
        )
        out = f"{name}_dequantized{self.count}"
        self.graph.node.append(helper.make_node("DequantizeLinear", [q, s, z], [out], axis=0))
        node.input[2] = out

    def _activation(self, tensor: str, grid: ActivationGrid, consumer: Any = None) -> None:
        from onnx import helper

        dtype = np.uint8 if not grid.spec.symmetric else np.int8
        scale = self._constant(f"{tensor}_scale", np.array(grid.scale.item(), np.float32))
        zero = self._constant(f"{tensor}_zero_point", np.array(int(grid.zero_point), dtype))
        quantized, restored, source = f"{tensor}_q{self.count}", f"{tensor}_dq{self.count}", tensor
        if consumer is None and any(output.name == tensor for output in self.graph.output):
            source, restored = f"{tensor}_float{self.count}", tensor  # a graph output keeps its name: DQ writes it
            for node in self.graph.node:
                for index, name in enumerate(node.output):
                    if name == tensor:
                        node.output[index] = source
        consumers = [consumer] if consumer is not None else [n for n in self.graph.node if tensor in n.input]
        for node in consumers:
            for index, name in enumerate(node.input):
                if name == tensor:
                    node.input[index] = restored
        self.graph.node.append(helper.make_node("QuantizeLinear", [source, scale, zero], [quantized]))
        self.graph.node.append(helper.make_node("DequantizeLinear", [quantized, scale, zero], [restored]))
        self.grids[restored] = grid


def _sort(graph: Any) -> None:
    """Order the nodes topologically (the inserted ones were appended)."""
    ready = {i.name for i in graph.initializer} | {i.name for i in graph.input} | {""}
    waiting, ordered = list(graph.node), []
    while waiting:
        left = []
        for node in waiting:
            if all(x in ready for x in node.input):
                ordered.append(node)
                ready.update(node.output)
            else:
                left.append(node)
        if len(left) == len(waiting):
            raise ConfigError("export.format", "onnx", "the quantized graph has a cycle (a bug: please report it)")
        waiting = left
    del graph.node[:]
    graph.node.extend(ordered)


def load_onnx(path: Path) -> Any:
    """An ONNX Runtime CPU session of the file, all graph optimizations on (int8 kernels fused)."""
    ort = required("onnxruntime", "onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = torch.get_num_threads()
    options.log_severity_level = 3  # errors only
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_onnx(session: Any, call: Call) -> list[Tensor]:
    """Every output of the session on one batch, its positional then keyword tensors fed in order."""
    values = [*call.args, *call.kwargs.values()]
    names = [i.name for i in session.get_inputs()]
    feeds = {name: v.detach().cpu().numpy() for name, v in zip(names, values) if isinstance(v, Tensor)}
    return [torch.from_numpy(np.asarray(o)) for o in session.run(None, feeds)]


register_export_format(
    ExportFormat(
        "onnx",
        write_onnx,
        load=load_onnx,
        suffix="onnx",
        takes_parts=True,
        holds_hooks=True,
        run=run_onnx,
        exact=False,
        target=DeployTarget(
            fold_batchnorm=True,
            layers=onnx_layer,
            weights={"bits": 8, "symmetric": True, "group_size": None},
            activations={"bits": 8, "symmetric": False, "per_channel": False},  # uint8: x86 s8s8 kernels are slow
            where="tensors",  # each tensor quantized once, where ONNX Runtime fuses DQ -> op (-> Relu) -> Q
        ),
    )
)
