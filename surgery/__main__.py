"""Command line: ``python -m surgery recipe=NAME [overrides]`` (also the ``surgery`` script)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from surgery.config import load_config
from surgery.errors import SurgeryError
from surgery.run import EXIT_BAD_INPUT, run
from surgery.sweeps import write_sweep_summary

PACKAGE = Path(__file__).resolve().parent
CONFIG_DIR = PACKAGE.parent / "conf" if (PACKAGE.parent / "recipes").is_dir() else PACKAGE / "conf"
GROUPS = ("recipe", "model", "data")
_exit_codes: list[int] = []
_sweep_jobs: list[tuple[dict[str, str], Path]] = []
_sweep_dir: list[Path] = []


def available(group: str, roots: list[Path]) -> list[str]:
    """Names of the YAML options of a config group in surgery's configs and extra ``roots``."""
    return sorted({p.stem for root in [CONFIG_DIR, *roots] for p in (root / group).glob("*.yaml")})


def _search_roots(overrides: list) -> list[Path] | None:
    """Folders added with ``hydra.searchpath=[file://...]``; None if a root cannot be listed."""
    roots: list[Path] = []
    for override in overrides:
        if override.key_or_group.lstrip("+") != "hydra.searchpath":
            continue
        for entry in override.value() or []:
            if not str(entry).startswith("file://"):
                return None
            roots.append(Path(str(entry)[len("file://"):]))
    return roots


def fail(message: str) -> int:
    print(f"surgery: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def preflight(arguments: list[str]) -> int:
    """Check config-group choices before Hydra composes, so a typo is one line and exit 2."""
    parser, overrides = OverridesParser.create(), []
    for argument in (a for a in arguments if not a.startswith("-") and "=" in a):
        try:
            overrides += parser.parse_overrides(overrides=[argument])
        except HydraException as err:
            return fail(f"cannot parse override {argument!r}: {str(err).splitlines()[0]}")
    roots = _search_roots(overrides)
    if roots is None:
        return 0  # package search paths: leave the check to Hydra
    for override in overrides:
        group = override.key_or_group.lstrip("+~")
        if group not in GROUPS or override.is_delete():
            continue
        values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
        options = available(group, roots)
        for value in values:
            if value not in options:
                return fail(f"{group}={value!r}: unknown {group}; available: {', '.join(options)}")
    return 0


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def _task(cfg: DictConfig) -> None:
    _exit_codes.append(-1)  # marks that composition succeeded and the job started
    hydra_config = HydraConfig.get()
    out_dir = Path(hydra_config.runtime.output_dir)
    if hydra_config.mode == RunMode.MULTIRUN:
        overrides = dict(o.split("=", 1) for o in hydra_config.overrides.task if "=" in o)
        _sweep_jobs.append((overrides, out_dir))
        _sweep_dir[:] = [Path(hydra_config.sweep.dir)]
    try:
        config = load_config(OmegaConf.to_container(cfg, resolve=True))
        result = run(config, out_dir)
    except SurgeryError as err:
        _exit_codes[-1] = fail(str(err).splitlines()[0])
        return
    _exit_codes[-1] = result.exit_code


def main() -> None:
    """Entry point of ``python -m surgery`` and the ``surgery`` console script."""
    code = preflight(sys.argv[1:])
    if code:
        sys.exit(code)
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # let composition errors reach us, unprinted
    try:
        _task()
    except (HydraException, OmegaConfBaseException) as err:
        if _exit_codes:
            raise
        lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line.startswith(" ")]
        sys.exit(fail(" ".join(lines[:3]) or type(err).__name__))
    if len(_sweep_jobs) > 1:
        try:
            files = write_sweep_summary(_sweep_dir[0], _sweep_jobs)
        except SurgeryError as err:
            _exit_codes.append(fail(str(err).splitlines()[0]))
        else:
            print(f"sweep summary: {', '.join(str(f) for f in files)}")
    sys.exit(max(_exit_codes, default=0))


if __name__ == "__main__":
    main()
