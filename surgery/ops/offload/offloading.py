"""``surgery.offloaded``: a model whose weights stay on disk, brought in block by block.

The model is built through :func:`surgery.intercept` with one parameter rule: every parameter
the constructor registers is set aside on the ``meta`` device (shape and dtype, no memory), and
the constructor's own initialisation runs on nothing. Its weights are then found in
safetensors files, opened with ``safetensors.safe_open`` (memory-mapped: nothing is read until
a tensor is asked for) and checked against the model: every parameter present, with the shape
and dtype the model was built with.

A forward-pre hook brings a group's weights in just before it runs and a forward hook releases
them after (also when the forward raises): the group is a repeated block (a decoder layer,
found as sequential calibration finds them), or for weights outside blocks the module owning
them. Resident memory is then the model's buffers, one group's weights and the activations.

We read the files ourselves rather than through accelerate's offload hooks or
compressed-tensors' offloading: the format is the one Hugging Face folders ship, and the hooks
are ours, so they are owned by a handle like every other hook the toolkit installs
(``restore()`` removes them and leaves the model on ``meta``). ``safetensors.safe_open``
checks each file; each tensor's bytes are then read with one positioned read, because pages
read through its memory map stay in the process's resident memory while the file is open.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from surgery.core._compat import get_slot, set_slot
from surgery.core.errors import ConfigError, ConfigTypeError
from surgery.core.handles import Handle
from surgery.core.hf_loading import from_pretrained, model_class, refuse_custom_code
from surgery.core.inputs import inputs_to, present_device
from surgery.core.safetensors_streams import DTYPES
from surgery.core.sequential import find_blocks
from surgery.core.verbs import OffloadedSource
from surgery.ops.build.intercept import RuleNeverFiredWarning, intercept
from surgery.ops.build.rules import on_parameter
from surgery.ops.offload.offloaded_conversion import ModelNamedFiles, model_named, unmapped_hint
from surgery.ops.offload.source_schemes import DequantizedFiles, SourceScheme, source_scheme

log = logging.getLogger("surgery")
FIELD = "offloaded.source"
INDEX = "model.safetensors.index.json"


def file_identity(status: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one version of a file from another without reading it: size, modification
    time (ns), inode and device (a file written again, or another put in its place, differs)."""
    return status.st_size, status.st_mtime_ns, status.st_ino, status.st_dev


class WeightFiles:
    """The tensors of safetensors files (a checkpoint's shards), by name, each read from disk
    when asked for. ``safe_open`` checks each file's header; the bytes are then read with a
    positioned read, not through its memory map: mapped pages would count as the process's
    resident memory until the file is closed, a whole shard of it. Each read first checks the
    file is the one whose header gave the offsets (:func:`file_identity`), so a shard replaced
    or rewritten while the model runs is refused, never read at stale offsets. ``digest`` is
    the sha256 of a file surgery wrote itself (a verb's stage), else None."""

    def __init__(self, paths: Iterable[Path], digest: str | None = None) -> None:
        self._where: dict[
            str, tuple[Path, int, int, str, tuple[int, ...]]
        ] = {}  # name -> file, start, end, dtype, shape
        self.paths: list[Path] = []
        self._identity: dict[Path, tuple[int, int, int, int]] = {}
        self._headers: dict[Path, str] = {}  # path -> sha256 of its header
        self.digest = digest
        for path in paths:
            self._open(Path(path))

    def _open(self, path: Path) -> None:
        if not path.is_file():
            raise ConfigError(FIELD, str(path), "is missing (a weights file the model needs)")
        try:
            with safe_open(str(path), framework="pt"):  # the header checked by safetensors itself
                pass
            with path.open("rb") as file:
                identity = file_identity(os.fstat(file.fileno()))
                raw = file.read(8)
                size = int.from_bytes(raw, "little")
                raw += file.read(size)
                header = json.loads(raw[8:])
        except (SafetensorError, OSError, ValueError) as err:
            raise ConfigError(
                FIELD, str(path), f"is not a safetensors file ({' '.join(str(err).split())[:80]})"
            ) from None
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            if key in self._where:
                raise ConfigError(FIELD, key, f"is in two files: {self._where[key][0].name} and {path.name}")
            begin, end = entry["data_offsets"]
            self._where[key] = (path, 8 + size + begin, 8 + size + end, entry["dtype"], tuple(entry["shape"]))
        self.paths.append(path)
        self._identity[path], self._headers[path] = identity, hashlib.sha256(raw).hexdigest()

    def identity(self) -> list[dict[str, Any]]:
        """Each file as it was opened: name, size, mtime_ns, inode and its header's sha256."""
        return [
            dict(zip(("file", "size", "mtime_ns", "inode"), (path.name, *self._identity[path][:3])))
            | {"header_sha256": self._headers[path]}
            for path in self.paths
        ]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def describe(self, name: str) -> tuple[tuple[int, ...], torch.dtype | str, str]:
        """(shape, dtype, file name) of ``name``, from the file's header."""
        path, _, _, kind, shape = self._where[name]
        return shape, DTYPES.get(kind, kind), path.name

    def load(self, name: str) -> Tensor:
        """The tensor ``name``, read from its file now."""
        path, begin, end, kind, shape = self._where[name]
        data = torch.empty(end - begin, dtype=torch.uint8)
        try:
            file = path.open("rb")
        except OSError as err:
            raise ConfigError(
                FIELD, str(path), f"cannot be read any more ({err.strerror}); it was there when opened"
            ) from None
        with file:
            if file_identity(os.fstat(file.fileno())) != self._identity[path]:
                raise ConfigError(
                    FIELD,
                    str(path),
                    "changed while the offloaded model reads it (written again, or another file put in its "
                    "place): its tensors are no longer where its header said; leave the files alone while it runs",
                )
            file.seek(begin)
            if file.readinto(data.numpy()) != end - begin:
                raise ConfigError(FIELD, name, f"is cut short in {path.name} (the file changed or was truncated)")
        return data.view(DTYPES[kind]).reshape(shape)


class Offloaded(Handle, OffloadedSource):
    """The hooks that bring an offloaded model's weights in group by group (see the module
    docstring). ``model`` is the model; ``groups`` the modules whose forward loads weights;
    ``files`` where they are read from. ``restore()`` removes the hooks (the model stays on
    ``meta``); :meth:`materialise` loads every weight and removes them."""

    def __init__(
        self, model: nn.Module, files: ModelNamedFiles, names: dict[int, str], device: torch.device | None = None
    ) -> None:
        super().__init__("offload", model)
        self.device = device or torch.device("cpu")  # where weights are brought in and the model computes
        self._owned = model  # the handle owns the model it built (other handles only watch theirs)
        self.files = files
        self.names = names  # id(placeholder parameter) -> its name in the files
        self.groups: list[str] = []
        self.overlay: dict[str, WeightFiles] = {}  # name -> the file of its compressed values
        self.held: list[tuple[nn.Module, str, nn.Parameter]] | None = None  # see holding_outside_blocks
        self.held_bytes = 0
        self.outside_bytes: list[int] = []  # each group's weights outside the blocks, in bytes
        self.source_scheme: str | None = None  # the quantization the files ship in ("fp8 (e4m3, ...)"), if any

    streams = True  # surgery.export writes it one tensor at a time
    spec = None  # no quantized weights (see OffloadedCompression)

    @property
    def grids(self) -> dict:
        """Quantized weights' grids: none (the model as its files hold it)."""
        return {}

    def value_of(self, tensor: Tensor) -> Tensor:
        """A tensor of the model's state with its values: a placeholder's read from disk."""
        return self.load(self.names[id(tensor)]) if tensor.is_meta and id(tensor) in self.names else tensor

    def load(self, name: str) -> Tensor:
        """The tensor ``name`` as the model now computes with it: compressed, if a verb wrote
        it to its overlay, else from the source files."""
        return self.overlay.get(name, self.files).load(name)

    @contextmanager
    def reading_source(self, active: bool = True) -> Iterator[None]:
        """Within the block (when ``active``) the model computes with the source files' weights,
        as it was before any verb wrote its overlay."""
        kept = self.overlay
        if active:
            self.overlay = {}
        try:
            yield
        finally:
            self.overlay = kept

    @contextmanager
    def holding_outside_blocks(self) -> Iterator[None]:
        """Within the block, weights outside the repeated blocks (the embeddings) stay in once
        brought in, and go back on exit: a forward run once per calibration batch up to a block
        reads them once, not once a batch. What is held stays within the largest such group's
        bytes, which one call brings in anyway (the embeddings, not an encoder's every layer);
        a block's weights still go after each call."""
        if self.held is not None:  # already holding
            yield
            return
        self.held, self.held_bytes = [], 0
        try:
            yield
        finally:
            held, self.held = self.held, None
            for owner, attr, placeholder in held:
                set_slot(owner, attr, placeholder)

    def hold(self, brought: list[tuple[nn.Module, str, nn.Parameter]]) -> bool:
        """Whether ``brought`` (a group's weights outside blocks, just used) is kept in: within
        :meth:`holding_outside_blocks` and its budget."""
        if self.held is None:  # every call outside a catch: nothing to weigh
            return False
        size = sum(p.numel() * p.element_size() for _, _, p in brought)
        if self.held_bytes + size > max(self.outside_bytes, default=0):
            return False
        self.held.extend(brought)
        self.held_bytes += size
        return True

    def names_in(self, module: nn.Module) -> list[str]:
        """The names in the files of ``module``'s weights (those set aside on ``meta``), sorted."""
        return sorted({self.names[id(p)] for sub in module.modules() for _, _, p in _own(sub)})

    @contextmanager
    def resident(self, module: nn.Module) -> Iterator[dict[str, nn.Parameter]]:
        """Hold ``module``'s weights in memory for the block (a verb edits them in place);
        yields them by name, and puts the placeholders back on exit."""
        slots = [slot for sub in module.modules() for slot in _own(sub)]
        loaded: dict[str, nn.Parameter] = {}
        try:
            for owner, attr, placeholder in slots:
                name = self.names[id(placeholder)]
                if name not in loaded:  # a weight two modules share is loaded once, still shared
                    loaded[name] = _loaded(self, name, placeholder)
                set_slot(owner, attr, loaded[name])
            yield loaded
        finally:
            for owner, attr, placeholder in slots:
                set_slot(owner, attr, placeholder)

    def materialise(self) -> nn.Module:
        """Load every weight into memory for good and remove the hooks: a plain model."""
        model = self._owned
        self.restore()
        for owner, attr, placeholder in _placeholders(model):
            set_slot(owner, attr, _loaded(self, self.names[id(placeholder)], placeholder))
        return model


def return_freed_memory() -> bool:
    """Have glibc give every freed large allocation back to the system at once, for the rest of
    the process: its default raises the size below which freed memory is kept for reuse up to
    the largest block freed so far (32 MiB), so a run that frees each block's tensors keeps tens
    of them resident. Measured, offloaded GPTQ on a random Llama of hidden 1024: peak beyond the
    imports 425-458 MB at 2 layers and 528-659 MB at 16 before, 263 and 319-327 MB after. The
    command line calls it for an offloaded run (the process is its own); a script can call it,
    or set ``MALLOC_MMAP_THRESHOLD_=131072``. False where the C library is not glibc."""
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024))  # M_MMAP_THRESHOLD: fixed, not adapted
    except (OSError, AttributeError):
        return False


def offloaded(
    source: str | Path | Iterable[str | Path],
    *,
    factory: Callable[[], nn.Module] | None = None,
    device: str | torch.device = "cpu",
) -> Offloaded:
    """Build a model without its weights and read them from disk as each part of it runs.

    Args:
        source: a Hugging Face folder (``config.json`` and ``model.safetensors`` or the shards
            ``model.safetensors.index.json`` lists), built from its config; or, with
            ``factory``, safetensors files (a folder of them, one file, or a list).
        factory: builds the model (``lambda: torchvision.models.resnet50()``); its weights,
            by their ``state_dict`` names, are those in the files.
        device: where each group's weights are brought in and computed (``"cuda"``: a model
            larger than the GPU, and than memory, runs and is compressed at the GPU's speed);
            its buffers and the inputs of each call go there too.

    Returns:
        An :class:`Offloaded` handle: ``handle.model`` runs like the model in memory, to the
        bit, holding one block's weights at a time.

    Example:
        >>> handle = surgery.offloaded("TinyLlama-folder")
        >>> logits = handle.model(input_ids).logits
    """
    place = present_device(device, "offloaded.device")
    paths, build, scheme = _source(source, factory)
    raw: Any = WeightFiles(paths)
    model = _build_on_meta(build)
    if scheme is not None:  # a checkpoint that ships quantized: each weight dequantized as it is read
        raw = DequantizedFiles(raw, *scheme, _float_dtype(model))
    files = model_named(model, raw)  # the files' tensors by the model's names, as transformers loads them
    names = _check_against(model, files)
    _load_buffers(model, files)
    handle = Offloaded(model, files, names, place)
    handle.source_scheme = None if scheme is None else scheme[0].describe(scheme[1])
    _move_buffers(model, place)
    _attach_onload(handle, model)
    if place.type != "cpu":  # each call's inputs moved where the weights are brought in
        handle.add_hook("inputs to the device", model.register_forward_pre_hook(inputs_to(place), with_kwargs=True))
    log.info("offloaded: %d weights in %d file(s), %d groups", len(names), len(files.paths), len(handle.groups))
    return handle


Source = tuple[list[Path], Callable[[], nn.Module], tuple[SourceScheme, dict[str, Any]] | None]


def _source(source: Any, factory: Callable[[], nn.Module] | None) -> Source:
    """The weights files, the builder of ``source`` and the scheme its weights ship quantized in,
    if any (one-line errors for what is not a model)."""
    if factory is not None and not callable(factory):
        raise ConfigTypeError("offloaded.factory", factory, "must be a callable that builds the model")
    if isinstance(source, (str, Path)):
        folder = Path(source)
        if not folder.exists():
            raise ConfigError(FIELD, str(source), "does not exist")
        if folder.is_file():
            if factory is None:
                raise ConfigError(
                    FIELD, str(source), "is one file: pass factory= to build the model it holds weights of"
                )
            return [folder], factory, None
        if factory is None:
            return _hugging_face(folder)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConfigError(FIELD, str(source), "holds no .safetensors files")
        return _shards(folder) if (folder / INDEX).is_file() else files, factory, None
    if factory is None:
        raise ConfigError(FIELD, "a list of files", "needs factory= to build the model they hold weights of")
    return [Path(p) for p in source], factory, None


def _hugging_face(folder: Path) -> Source:
    if not (folder / "config.json").is_file():
        raise ConfigError(
            FIELD,
            str(folder),
            "is not a model: no config.json (a Hugging Face folder); for other models pass factory= with the files",
        )
    import transformers

    refuse_custom_code(folder, FIELD)  # outside the try: its own one-line error
    try:
        config = from_pretrained(transformers.AutoConfig, folder, FIELD)
    except (ValueError, OSError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(FIELD, str(folder / "config.json"), f"is not a model config ({str(err)[:80]})") from None
    architectures = getattr(config, "architectures", None)
    architecture = architectures[0] if isinstance(architectures, (list, tuple)) and architectures else architectures
    built_by = model_class(transformers, architecture, FIELD, folder / "config.json", config)
    if (folder / INDEX).is_file():
        paths = _shards(folder)
    elif (folder / "model.safetensors").is_file():
        paths = [folder / "model.safetensors"]
    else:
        raise ConfigError(FIELD, str(folder), "holds no model.safetensors (nor model.safetensors.index.json)")
    dtype = getattr(config, "dtype", None)

    def build() -> nn.Module:
        floating = isinstance(dtype, torch.dtype) and dtype.is_floating_point
        before = torch.get_default_dtype()
        try:  # as from_pretrained builds it: parameters in the config's dtype, float32 kept where asked for
            torch.set_default_dtype(dtype if floating else before)
            model = built_by(config)
        except (AttributeError, TypeError, ValueError, KeyError) as err:  # a config the class cannot read
            first = " ".join(str(err).split())[:120]
            raise ConfigError(
                FIELD, str(folder / "config.json"), f"is not a model config {built_by.__name__} builds ({first})"
            ) from None
        finally:
            torch.set_default_dtype(before)
        return model

    return paths, build, source_scheme(config, folder / "config.json")


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a quantized source's weights are dequantized to: the model's (its first floating
    parameter's), as transformers dequantizes to the parameter it loads into."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def _shards(folder: Path) -> list[Path]:
    """The shard files ``model.safetensors.index.json`` lists, each checked to exist."""
    try:
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise ConfigError(FIELD, str(folder / INDEX), f"is not a safetensors index ({type(err).__name__})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise ConfigError(
            FIELD,
            str(folder / INDEX),
            "is not a safetensors index (its weight_map must map tensor names to file names)",
        )
    shards = list(dict.fromkeys(weight_map.values()))
    for shard in shards:
        if Path(shard).name != shard or shard in (".", ".."):
            raise ConfigError(FIELD, str(folder / INDEX), f"lists {shard!r}: shards are plain file names in the folder")
        path = folder / shard
        if not os.path.lexists(path):
            raise ConfigError(FIELD, str(path), f"is listed in {INDEX} but missing")
        if not path.is_file():
            raise ConfigError(FIELD, str(path), f"is listed in {INDEX} but is not a regular file")
    return [folder / shard for shard in shards]


def _build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """The model ``build()`` makes, with every parameter set aside on ``meta`` as it is registered."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuleNeverFiredWarning)  # a model without parameters is no mistake here
        with intercept(on_parameter(lambda parent, name, value: True, _to_meta)):
            model = build()
    if not isinstance(model, nn.Module):
        raise ConfigTypeError("offloaded.factory", model, "must build an nn.Module")
    return model.eval()


def _to_meta(param: nn.Parameter) -> Tensor:
    return torch.empty_like(param, device="meta")


def _check_against(model: nn.Module, files: ModelNamedFiles) -> dict[int, str]:
    """Every parameter's name in the files, checked for presence, shape and dtype."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters():
        if name not in files:
            raise ConfigError(
                FIELD, name, f"is a parameter of the model but in none of {_listed(files)}{unmapped_hint(files)}"
            )
        shape, dtype, file = files.describe(name)
        if shape != tuple(param.shape) or dtype != param.dtype:
            raise ConfigError(
                FIELD,
                name,
                f"is {list(shape)} {dtype} in {file}, but the model built from the config has "
                f"{list(param.shape)} {param.dtype}",
            )
        names[id(param)] = name
        param.offloaded_to = file  # said by a verb that cannot run on it
    unused = len(files.unmapped)
    if unused:
        log.warning("offloaded: %d tensors in the files are not the model's (ignored)", unused)
    return names


def _listed(files: ModelNamedFiles) -> str:
    shown = ", ".join(p.name for p in files.paths[:3])
    more = f" and {len(files.paths) - 3} more" if len(files.paths) > 3 else ""
    return f"{shown}{more} in {files.paths[0].parent}" if files.paths else "the files"


def _load_buffers(model: nn.Module, files: ModelNamedFiles) -> None:
    """Persistent buffers (running statistics) are small: read once, checked like weights."""
    buffers = dict(model.named_buffers())
    for name in model.state_dict(keep_vars=True):
        if name not in buffers or name not in files:
            continue
        value = files.load(name)
        if value.shape != buffers[name].shape:
            raise ConfigError(
                FIELD, name, f"is {list(value.shape)} in the files, the model has {list(buffers[name].shape)}"
            )
        with torch.no_grad():
            buffers[name].copy_(value)


def _placeholders(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if param.is_meta:
                yield module, attr, param


def _loaded(handle: Offloaded, name: str, placeholder: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(handle.load(name).to(handle.device), requires_grad=placeholder.requires_grad)


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    """Every buffer (small: running statistics, rotary tables) on ``device`` for good."""
    if device.type == "cpu":
        return
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.to(device))  # a registered buffer stays one (nn.Module.__setattr__)


class _Onload:
    """The pre-hook and hook of one group: bring in its weights not already in (a block being
    run brings its layers' in), then put back the placeholders of those it brought."""

    only_moves_weights = True  # a verb may stand a module in for its owner while the weights are held

    def __init__(
        self, handle: Offloaded, slots: list[tuple[nn.Module, str, nn.Parameter]], outside_blocks: bool
    ) -> None:
        self.handle, self.slots, self.outside_blocks = handle, slots, outside_blocks
        self.brought: list[list[tuple[nn.Module, str, nn.Parameter]]] = []  # a stack: calls may nest

    def bring_in(self, module: nn.Module, args: Any) -> None:
        brought = []
        for owner, attr, placeholder in self.slots:
            if get_slot(owner, attr) is placeholder:
                set_slot(owner, attr, _loaded(self.handle, self.handle.names[id(placeholder)], placeholder))
                brought.append((owner, attr, placeholder))
        self.brought.append(brought)

    def release(self, module: nn.Module, args: Any, output: Any) -> None:
        brought = self.brought.pop() if self.brought else []
        if self.outside_blocks and self.handle.hold(brought):  # kept in until holding_outside_blocks ends
            return
        for owner, attr, placeholder in brought:
            set_slot(owner, attr, placeholder)


def _attach_onload(handle: Offloaded, model: nn.Module) -> None:
    """A group per block (its weights brought in together, for code that reads a layer's
    weight from the block), and one per module owning weights (for a block that is never
    called itself, and weights outside blocks)."""
    blocks = find_blocks(model)
    inside: set[int] = set()
    groups: list[tuple[str, nn.Module, list]] = []
    for name in blocks:
        block = model.get_submodule(name)
        groups.append((name, block, [slot for sub in block.modules() for slot in _own(sub)]))
        inside.update(id(sub) for sub in block.modules())
    for name, module in model.named_modules():
        if _own(module):
            groups.append((name, module, _own(module)))
    for index, (_, module, slots) in enumerate(groups):
        onload = _Onload(handle, slots, outside_blocks=index >= len(blocks) and id(module) not in inside)
        if onload.outside_blocks:
            handle.outside_bytes.append(sum(p.numel() * p.element_size() for _, _, p in slots))
        handle.add_hook("bring weights in", module.register_forward_pre_hook(onload.bring_in))
        handle.add_hook("release weights", module.register_forward_hook(onload.release, always_call=True))
    handle.groups = blocks + [name for name, module, _ in groups[len(blocks) :] if id(module) not in inside]


def _own(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    return [
        (module, attr, p) for attr, p in module.named_parameters(recurse=False, remove_duplicate=False) if p.is_meta
    ]
