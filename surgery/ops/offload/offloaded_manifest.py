"""The manifest of an offloaded verb's ``work=`` folder, and what a restarted run checks
before it adopts a finished stage: the same settings and calibration batches, the same source
files (each shard's size, ``mtime_ns``, inode and the sha256 of its safetensors header: a
digest of whole multi-GB shards would cost a read of the model), the same state of the model
before the verb (the sha256 of each stage file earlier verbs wrote), and each stage file the
one the run wrote (its sha256), under its plain name. Anything else is refused in one line:
the folder is never resumed silently."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from surgery.core.errors import ConfigError
from surgery.ops.offload.offloading import WeightFiles

FRESH = "give a fresh folder, or delete this one to resume nothing"
SHA256 = re.compile(r"[0-9a-f]{64}")
EXPERT_GRID = re.compile(r"(?P<owner>.+)\.\d+\.(?P<layer>gate_proj|up_proj|down_proj)\.weight")
FUSED = {"gate_proj": ("gate_up_proj",), "up_proj": ("gate_up_proj", "up_proj"), "down_proj": ("down_proj",)}
FIELDS = (("settings", str), ("calibration", str), ("source", list), ("before", str), ("stages", dict))


def stage_name(index: int) -> str:
    """The file of stage ``index`` in the work folder."""
    return f"stage-{index:05d}.safetensors"


def grid_held(key: str, names: Any) -> bool:
    """Whether a stage holding the weights ``names`` holds the weight a grid ``key`` quantizes: one
    of them, or one expert's layer of a fused experts weight among them (``experts.3.gate_proj.weight``
    of ``experts.gate_up_proj``: a verb quantizes each expert as a layer of its own, baked fused)."""
    if key in names:
        return True
    found = EXPERT_GRID.fullmatch(key)
    return found is not None and any(f"{found['owner']}.{fused}" in names for fused in FUSED[found["layer"]])


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def state_digest(overlay: dict[str, WeightFiles]) -> str:
    """The state of an offloaded model before a verb: which weights earlier verbs rewrote, and
    the sha256 of the stage file each is read from (none: the source files as they are)."""
    digest = hashlib.sha256()
    for name in sorted(overlay):
        digest.update(f"{name}={overlay[name].digest}\n".encode())
    return digest.hexdigest()


def checked(manifest: Any, file: Path, stages: int) -> dict[str, Any]:
    """``manifest`` (read from ``file``) if it has the shape surgery writes; a one-line error
    naming the folder and what is wrong otherwise."""

    def wrong(what: str) -> NoReturn:
        raise ConfigError("work", str(file), f"is not a manifest this surgery wrote ({what}); {FRESH}")

    if not isinstance(manifest, dict):
        wrong(f"a JSON {type(manifest).__name__}, not an object")
    for key, kind in FIELDS:
        if not isinstance(manifest.get(key), kind):
            wrong(f"{key!r} is {type(manifest.get(key)).__name__}, not {kind.__name__}")
    finished = manifest["stages"]
    if set(finished) != {str(index) for index in range(len(finished))} or len(finished) > stages:
        wrong(f"'stages' are not 0, 1, ... up to the run's {stages} stages")
    for key, entry in finished.items():
        _check_entry(entry, int(key), wrong)
    return manifest


def _check_entry(entry: Any, index: int, wrong: Callable[[str], NoReturn]) -> None:
    """One stage's entry: its plain file name, module, names, grids and digest."""
    where = f"stage {index}"
    if not isinstance(entry, dict):
        wrong(f"{where} is {type(entry).__name__}, not an object")
    if entry.get("file") != stage_name(index):
        wrong(f"{where}'s file is {entry.get('file')!r}, not the plain name {stage_name(index)!r}")
    names, grids = entry.get("names"), entry.get("grids")
    if not isinstance(entry.get("module"), str) or not isinstance(names, list) or not isinstance(grids, dict):
        wrong(f"{where} needs 'module' (a string), 'names' (a list) and 'grids' (an object)")
    if not all(isinstance(name, str) for name in names) or not all(grid_held(key, names) for key in grids):
        wrong(f"{where}'s names are not strings, or its grids name weights it does not hold")
    if not all(axis is None or type(axis) is int for axis in grids.values()):
        wrong(f"{where}'s grid axes are not integers")
    if not isinstance(entry.get("sha256"), str) or not SHA256.fullmatch(entry["sha256"]):
        wrong(f"{where} has no sha256 of its file")


def mismatch(found: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """What differs between a folder's manifest and this run (None: it may resume)."""
    if found["settings"] != expected["settings"] or found["calibration"] != expected["calibration"]:
        return "holds a run with other settings or calibration batches"
    if found["source"] != expected["source"]:
        return f"holds a run of other source files ({_changed(found['source'], expected['source'])})"
    if found["before"] != expected["before"]:
        return "holds a run that began from another state of the model (other verbs ran before it, or others' results)"
    return None


def _changed(found: list, expected: list) -> str:
    """The first source file that differs, and how."""
    for was, now in zip(found, expected):
        if was != now:
            keys = [key for key in now if not isinstance(was, dict) or was.get(key) != now[key]]
            return f"{now['file']}: its {', '.join(keys)} differ"
    return f"{len(found)} file(s) then, {len(expected)} now"


def check_stage(entry: dict[str, Any], path: Path, where: str, names: list[str]) -> None:
    """A finished stage may be adopted: it is this stage (module and weights) and its file is
    the one the run wrote."""
    if entry["module"] != where:
        raise ConfigError(
            "work", str(path.parent), f"lists {path.name} as {entry['module']}'s weights, not {where}'s; {FRESH}"
        )
    if sorted(entry["names"]) != names:
        other = sorted(set(entry["names"]) ^ set(names))[0]
        raise ConfigError(
            "work", str(path.parent), f"lists {path.name} with other weights than {where}'s ({other}); {FRESH}"
        )
    if not path.is_file() or file_sha256(path) != entry["sha256"]:
        raise ConfigError(
            "work",
            str(path),
            f"is missing or not the file the run wrote (its sha256 differs from the manifest's); {FRESH}",
        )
