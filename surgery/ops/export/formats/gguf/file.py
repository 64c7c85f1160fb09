"""``format="gguf"``: one GGUF file that llama.cpp (and ollama, LM Studio, llama-cpp-python on
it) runs, written with gguf-py from surgery's own integers and scales: each quantized weight in
the GGUF block type that holds its grid exactly (:mod:`.gguf_blocks`), never re-quantized;
what stays float in the model's dtype (norms and biases in F32, as llama.cpp keeps them).

The file loads back in transformers (``from_pretrained(folder, gguf_file=...)``, which
dequantizes every tensor with gguf-py and undoes llama.cpp's query/key row order): that model
computes the simulation's outputs bit for bit, the export's parity check.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from surgery.core.errors import ConfigError
from surgery.core.hf_loading import from_pretrained
from surgery.ops.export.format_table import ExportFormat, register_export_format
from surgery.ops.export.formats.gguf.blocks import BLOCK_TYPES, FLOAT_TYPES, BlockType, tensor_bytes
from surgery.ops.export.formats.gguf.entries import Entry, entries
from surgery.ops.export.formats.gguf.llama_cpp_runtime import llama_cpp_summary
from surgery.ops.export.formats.gguf.mix_types import GGUF_MIXES, mix_type, type_name
from surgery.ops.export.formats.gguf.models import family_of, is_float_tensor, metadata, permute_rows
from surgery.ops.export.formats.gguf.tokenizer import vocabulary, write_vocabulary
from surgery.ops.export.formats.requirements import required
from surgery.ops.numerics.deployment import ExportParts, WeightGrid
from surgery.ops.numerics.grid import GridSpec
from surgery.ops.quantization.targets import DEPLOY_TARGETS, DeployTarget

log = logging.getLogger("surgery")
OPTIONS = ("type", "tokenizer")
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0"}
FILE_TYPES |= {"Q4_0": "MOSTLY_Q4_0", "Q5_0": "MOSTLY_Q5_0", "Q4_1": "MOSTLY_Q4_1", "Q5_1": "MOSTLY_Q5_1"}
FILE_TYPES |= {"Q3_K": "MOSTLY_Q3_K_S", "Q4_K": "MOSTLY_Q4_K_S", "Q5_K": "MOSTLY_Q5_K_S", "Q6_K": "MOSTLY_Q6_K"}


def write_gguf(parts: ExportParts, path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Write ``parts`` (a Hugging Face decoder under surgery) as one GGUF file at ``path``.

    Options: ``type``, a GGUF type every quantized weight must be written as (one of
    :data:`BLOCK_TYPES`), or a llama.cpp file type (``Q4_K_M``, ``Q5_K_M``) whose rules give each
    weight its type (as :func:`surgery.gguf_mix` plans them); by default each grid picks;
    ``tokenizer``: a Hugging Face fast tokenizer (or its folder) llama.cpp can reproduce
    (:mod:`.gguf_tokenizer`); without one, a byte-level model (256 tokens) carries its byte
    vocabulary and any other writes none (llama.cpp then takes token ids)."""
    if parts.activations:
        _refuse_activations(next(iter(parts.activations))[0])
    return _write(parts.model, path, options, parts.weights, lambda value: value.detach())


def stream_gguf(handle: Any, path: Path, options: dict[str, Any]) -> dict[str, Any]:
    """Write an offloaded model's quantized result (:func:`surgery.quantize` given
    :func:`surgery.offloaded`'s handle) as one GGUF file, each tensor read from its file as it
    is written: memory holds one tensor."""
    spec = getattr(handle, "spec", None)  # the weights' grid (an offloaded verb quantizes weights only)
    found = handle.grids
    if found and not isinstance(spec, GridSpec):
        raise ConfigError("export.handle", handle.kind, "format='gguf' streams an offloaded quantize's weights")
    grids = {name: WeightGrid(name, spec, scale, zero_point, axis) for name, (scale, zero_point, axis) in found.items()}
    return _write(handle.model, path, options, grids, handle.value_of)


def _refuse_activations(layer: str) -> None:
    raise ConfigError(
        "export.format",
        "gguf",
        f"holds weight grids only; {layer} activations are quantized (llama.cpp rounds activations "
        "itself): export a run without activation quantization",
    )


def _write(
    model: nn.Module, path: Path, options: dict[str, Any], grids: dict[str, WeightGrid], read: Any
) -> dict[str, Any]:
    """The file, one tensor at a time: every tensor's name, type and size (and every refusal)
    first, from shapes and ``grids`` alone; then each tensor read (``read(parameter)``), packed
    and written."""
    gguf = required("gguf", "gguf")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError("export.options", unknown, f"format='gguf' takes {', '.join(OPTIONS)}")
    config = getattr(model, "config", None)
    family = family_of(config)  # another model is refused before its tensors are named
    wanted = _wanted_type(options.get("type"), int(config.num_hidden_layers))
    vocab = vocabulary(options.get("tokenizer"), config, gguf.vocab.bytes_to_unicode)
    tensors = entries(model, grids)
    planned = [_planned(entry, wanted) for entry in tensors]
    writer = gguf.GGUFWriter(str(path), family.architecture)
    writer.add_name(Path(str(getattr(config, "name_or_path", "") or "")).name or type(model).__name__)  # no local path
    for method, value in metadata(config, family):
        getattr(writer, method)(value)
    quantized = Counter(kind.name for _, kind, _ in planned if isinstance(kind, BlockType))
    main = quantized.most_common(1)[0][0] if quantized else FLOAT_TYPES.get(model.dtype, "F32")
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[main]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_vocabulary(writer, vocab, gguf)  # nothing the outputs depend on: the file stays exact
    for gguf_name, kind, shape in planned:
        raw = getattr(gguf.GGMLQuantizationType, kind if isinstance(kind, str) else kind.name)
        nbytes, byte_shape = tensor_bytes(kind, shape)
        if kind in ("F32", "F16"):
            writer.add_tensor_info(gguf_name, shape, np.dtype(kind.replace("F", "float")), nbytes)
        else:
            writer.add_tensor_info(gguf_name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=raw)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for entry, (_, kind, shape) in zip(tensors, planned):
            writer.write_tensor_data(_data(entry, read, config, kind).reshape(*shape[:-1], -1))
    finally:
        writer.close()
    return {}


def _planned(entry: Entry, wanted: Wanted) -> tuple:
    """(GGUF name, its type: a BlockType or a float type's name, its ([experts,] rows..., columns)
    shape) of one tensor, from shapes and grids; what GGUF cannot hold is refused here."""
    first, grid = entry.sources[0], entry.grids[0]
    if all(g is None for g in entry.grids):
        kind = "F32" if is_float_tensor(entry.name, first) else FLOAT_TYPES.get(first.dtype)
        if kind is None:
            raise ConfigError("export.format", "gguf", f"{entry.key} is {first.dtype}; GGUF holds F32, F16 and BF16")
        shape = tuple(first.shape) if len(entry.sources) == 1 else (len(entry.sources), *first.shape)
        if entry.rows is not None:
            shape = (shape[0], entry.rows.stop - entry.rows.start, *shape[2:])
        return entry.name, kind, shape
    if any(g is None for g in entry.grids):
        raise ConfigError(
            "export.format", "gguf", f"{entry.name} stacks experts some quantized, some not ({entry.key}); quantize all"
        )
    one = entry.one_shape
    rows = one[grid.output_axis]
    columns = math.prod(one) // rows
    kind = _block_type(entry.key, grid, columns, wanted(entry.name))
    for other in entry.grids[1:]:  # one type holds every expert's grid
        _block_type(other.key, other, columns, kind)
    shape = (
        (rows, columns)
        if not entry.stacked
        else (len(entry.grids) if entry.fused else len(entry.sources), rows, columns)
    )
    return entry.name, kind, shape


Wanted = Callable[[str], "BlockType | None"]  # a tensor's GGUF name -> the type it must be written as


def _wanted_type(name: object, layers: int) -> Wanted:
    """``export.options.type``: one type for every quantized tensor, or a llama.cpp file type
    (``Q4_K_M``) whose rules give each tensor its own; None: each grid picks."""
    if name is None:
        return lambda _: None
    type_name(name, "export.options.type", [*BLOCK_TYPES, *GGUF_MIXES])
    if name in GGUF_MIXES:
        return lambda gguf_name: BLOCK_TYPES[mix_type(name, gguf_name, layers)]
    return lambda _: BLOCK_TYPES[name]


def _data(entry: Entry, read: Any, config: Any, kind: Any) -> np.ndarray:
    """One tensor's bytes as ``kind`` (each expert's after the other): a float type's values, or
    the packed blocks of each grid's integers; in llama.cpp's row order."""
    rows = None if entry.fused else entry.rows  # a fused one's experts come with their rows taken
    values = entry.values(read)
    return np.concatenate(
        [_one(entry.name, value, grid, config, kind, rows) for value, grid in zip(values, entry.grids)]
    )


def _one(name: str, value: Tensor, grid: WeightGrid | None, config: Any, kind: Any, rows: slice | None) -> np.ndarray:
    permute = permute_rows(name, config)
    if grid is None:
        value = value.detach().float() if kind == "F32" else value.detach()
        value = value if rows is None else value[:, rows]
        value = (value if permute is None else permute(value)).cpu().contiguous()
        data = value.view(torch.int16).numpy().view(np.uint8) if kind == "BF16" else value.numpy()
        return data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data
    integers = grid.integers(value)
    if permute is not None:
        count = integers.shape[0]
        grid = dataclasses.replace(
            grid,
            scale=permute(grid.scale.reshape(count, -1)),
            zero_point=permute(grid.zero_point.reshape(count, -1)),
        )
        integers = permute(integers)
    return kind.encode(grid, integers)


def _block_type(name: str, grid: WeightGrid, columns: int, wanted: BlockType | None) -> BlockType:
    """The GGUF type that holds ``grid`` exactly (``wanted``, or the first of its bits that does);
    none: refused in one line naming the weight, the type and what it needs."""
    fewest = sorted(BLOCK_TYPES.values(), key=lambda t: t.bits)
    candidates = [wanted] if wanted is not None else [t for t in fewest if t.bits >= grid.spec.bits]
    reasons = []
    for kind in candidates:
        why = kind.holds(grid, columns)
        if why is None:
            if kind.bits > grid.spec.bits:
                log.warning("export: %s is written as %s, the smallest GGUF type that holds its grid", name, kind.name)
            return kind
        if kind.bits == candidates[0].bits:  # what the types of the grid's own bits need
            reasons.append(f"{kind.name} needs {why}")
    raise ConfigError(
        "export.format",
        "gguf",
        f"cannot hold {name} exactly: {'; '.join(reasons)}; quantize with target='gguf:<type>' "
        f"({', '.join(BLOCK_TYPES)})",
    )


def load_gguf(path: Path) -> nn.Module:
    """The file loaded by transformers (dequantized by gguf-py), in eval mode, in the dtype of its
    float weights (bfloat16 or float16 where the model was: a block's values rounded to it as the
    simulation rounds them; float32 otherwise). Its GGUF loader reads no head size for
    Qwen2/Qwen3 (it keeps the config's default): the file's ``attention.key_length`` is passed
    in; a tensor it would re-initialise is refused."""
    import transformers

    gguf = required("gguf", "gguf")
    reader = gguf.GGUFReader(str(path))
    fields = reader.fields
    kinds = {gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors if len(t.shape) > 1}
    dtype = torch.bfloat16 if "BF16" in kinds else torch.float16 if "F16" in kinds else torch.float32
    architecture = bytes(fields["general.architecture"].parts[-1]).decode()
    key_length = fields.get(f"{architecture}.attention.key_length")
    config = from_pretrained(transformers.AutoConfig, path.parent, "export.load", gguf_file=path.name)
    if key_length is not None:
        config.head_dim = int(key_length.parts[-1][0])
    expert_length = fields.get(f"{architecture}.expert_feed_forward_length")  # its loader reads none either
    if expert_length is not None:
        config.moe_intermediate_size = int(expert_length.parts[-1][0])
    model, info = from_pretrained(
        transformers.AutoModelForCausalLM,
        path.parent,
        "export.load",
        gguf_file=path.name,
        config=config,
        dtype=dtype,
        output_loading_info=True,
    )
    wrong = sorted(
        str(k) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys") for k in info.get(kind, [])
    )
    if wrong:
        raise ConfigError(
            "export.load", path.name, f"transformers loads it with tensors missing or reshaped: {wrong[:3]}"
        )
    return model.eval()


register_export_format(
    ExportFormat(
        "gguf",
        write_gguf,
        load=load_gguf,
        suffix="gguf",
        takes_parts=True,
        stream=stream_gguf,
        holds_float_offset=True,
        also_runs_in=(("llama_cpp", llama_cpp_summary),),
    )
)


def _target_check(kind: BlockType) -> Callable[[nn.Module, Any, dict[str, Any]], None]:
    """What ``quantize(target="gguf:TYPE")`` refuses when it starts, before any calibration: a model
    GGUF cannot write, quantized activations, scattered groups, a layer whose inputs the type's
    blocks do not tile."""

    def check(model: nn.Module, spec: Any, matched: dict[str, Any]) -> None:
        field, name = "quantize.target", f"gguf:{kind.name}"
        family_of(getattr(model, "config", None))
        if spec.activations is not None:
            raise ConfigError(
                field, name, "holds weight grids only (llama.cpp rounds activations itself): set no activations"
            )
        if getattr(spec.method, "actorder", None) == "group":
            raise ConfigError(
                "quantize.method.actorder",
                "group",
                f"target={name!r} holds groups of consecutive inputs only (no g_idx): use actorder='weight'",
            )
        for key, target in matched.items():  # (K-quants' super-blocks: refused by the grid's own super_group)
            columns = target.param.shape[-1]
            if kind.scale_levels is None and columns % kind.super_block:
                raise ConfigError(
                    field,
                    name,
                    f"cannot hold {key}: its {columns} inputs are not a multiple of {kind.super_block} "
                    f"({kind.name}'s blocks); exclude it, or pick a type whose blocks tile it",
                )

    return check


for _name, _kind in BLOCK_TYPES.items():  # quantize(target="gguf:Q4_0"): compute on that type's grid
    _rules = DeployTarget(layers=(nn.Linear,), weights=dict(_kind.target), check=_target_check(_kind))
    DEPLOY_TARGETS.register(f"gguf:{_name}", _rules, replace=True)
