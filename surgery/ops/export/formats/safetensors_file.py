"""``safetensors``: the weights as they compute now (the default format; no runtime of its own)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import nn

from surgery.core.checkpoints import cpu_state
from surgery.core.errors import ConfigError
from surgery.core.safetensors_streams import write_streamed
from surgery.ops.export.format_table import ExportFormat, register_export_format


def write_safetensors(model: nn.Module, path: Path, options: dict[str, Any]) -> None:
    if options:
        raise ConfigError("export.options", sorted(options), "format='safetensors' takes no options")
    save_file(cpu_state(model), str(path))


def stream_safetensors(handle: Any, path: Path, options: dict[str, Any]) -> None:
    """The offloaded model's state, as it computes now, one tensor read at a time."""
    if options:
        raise ConfigError("export.options", sorted(options), "format='safetensors' takes no options")
    state = handle.model.state_dict(keep_vars=True)
    entries = [(name, tuple(value.shape), value.dtype) for name, value in state.items()]
    write_streamed(path, entries, lambda name: handle.value_of(state[name]))


register_export_format(
    ExportFormat(
        "safetensors",
        write_safetensors,
        load=lambda path: load_file(str(path)),
        suffix="safetensors",
        stream=stream_safetensors,
    )
)
