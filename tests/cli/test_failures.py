"""An OSError of a run names the field whose path failed, not always the output folder."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace

from surgery.cli.failures import os_error_as_config_error, with_cli_field


def config_with(**paths: str) -> SimpleNamespace:
    """The path fields of a run's config (the rest of a RunConfig plays no part)."""
    model = SimpleNamespace(weights=None, path=paths.get("model_path"), offload_folder=None)
    data = SimpleNamespace(root=None, text=None, tokenizer=None, activation_folder=paths.get("activation_folder"))
    export = SimpleNamespace(options={"tokenizer": paths["tokenizer"]} if "tokenizer" in paths else {})
    return SimpleNamespace(model=model, data=data, export=export)


def test_a_failed_path_is_named_by_its_field(tmp_path: Path):
    out = tmp_path / "run"
    config = config_with(
        model_path=str(tmp_path / "llama"), activation_folder=str(tmp_path / "spill"), tokenizer=str(tmp_path / "tok")
    )
    cases = {
        tmp_path / "llama" / "config.json": "model.path=",
        tmp_path / "spill" / "a.pt": "data.activation_folder=",
        tmp_path / "tok" / "tokenizer.json": "export.options.tokenizer=",
        tmp_path / "elsewhere" / "x": "file=",
    }
    for path, field in cases.items():
        error = os_error_as_config_error(OSError(errno.EACCES, "Permission denied", str(path)), config, out)
        assert str(error).startswith(f"{field}{str(path)!r}: cannot be used (Permission denied)"), str(error)


def test_a_staged_output_is_named_as_it_would_be_published(tmp_path: Path):
    out = tmp_path / "run"
    staged = out / ".staging-host-1-abc" / ".export.4q1yabcs.tmp" / "model.safetensors"
    error = os_error_as_config_error(OSError(errno.ENOSPC, "No space left on device", str(staged)), None, out)
    assert str(error) == (
        f"output={str(out / 'export' / 'model.safetensors')!r}: cannot be written (No space left on device); "
        "nothing was written"
    )
    assert str(os_error_as_config_error(OSError("boom"), None, out)).startswith(f"output={str(out)!r}")


def test_a_library_argument_is_named_as_the_command_lines_setting():
    from surgery.core.errors import ConfigError

    error = with_cli_field(ConfigError("work", "/x/quantize", "is a file; give a folder"))
    assert str(error) == "model.offload_folder='/x/quantize': is a file; give a folder"
    other = ConfigError("prune.amount", 2, "must be a number in [0, 1]")
    assert with_cli_field(other) is other
