"""Command line: ``python -m surgery recipe=NAME [overrides]`` (also the ``surgery`` script)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from surgery.config import load_config
from surgery.errors import SurgeryError
from surgery.run import EXIT_BAD_INPUT, run

PACKAGE = Path(__file__).resolve().parent
CONFIG_DIR = PACKAGE.parent / "conf" if (PACKAGE.parent / "recipes").is_dir() else PACKAGE / "conf"
GROUPS = {"recipe": "recipe", "model": "model", "data": "data"}
_exit_codes: list[int] = []


def available(group: str) -> list[str]:
    """Names of the YAML options of a config group shipped with surgery."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def fail(message: str) -> int:
    print(f"surgery: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def preflight(arguments: list[str]) -> int:
    """Check config-group choices before Hydra composes, so a typo is one line and exit 2."""
    overrides = [a for a in arguments if not a.startswith("-") and "=" in a]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    except HydraException as err:
        return fail(str(err).splitlines()[0])
    for override in parsed:
        group = override.key_or_group.lstrip("+~")
        if group not in GROUPS or override.is_delete():
            continue
        values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
        for value in values:
            if value not in available(group):
                return fail(f"{group}={value!r}: unknown {group}; available: {', '.join(available(group))}")
    return 0


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def _task(cfg: DictConfig) -> None:
    _exit_codes.append(-1)  # marks that composition succeeded and the job started
    out_dir = Path(HydraConfig.get().runtime.output_dir)
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
    try:
        _task()
    except SystemExit as stop:
        if not _exit_codes and stop.code not in (0, None):
            sys.exit(EXIT_BAD_INPUT)  # Hydra rejected the configuration before any job ran
        raise
    sys.exit(max(_exit_codes, default=0))


if __name__ == "__main__":
    main()
