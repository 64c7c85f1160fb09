"""Command line: ``python -m surgery recipe=NAME [overrides]`` (also the ``surgery`` script)."""

from __future__ import annotations

import os
import signal
import sys
import traceback
import warnings
from contextvars import ContextVar
from pathlib import Path

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from surgery.cli.config_loading import load_config
from surgery.cli.objective import WORST, objective_value
from surgery.cli.preview import preview
from surgery.cli.run import EXIT_BAD_INPUT, EXIT_OK, run
from surgery.cli.sweeps import JobRecord, current_sweep, finish_sweep, forget_sweep, record_job
from surgery.core._compat import quiet_pytree_deprecations
from surgery.core.errors import SurgeryError
from surgery.core.interrupts import Terminated, raise_pending, taken_at_safe_points

PACKAGE = Path(__file__).resolve().parents[1]  # surgery/
CONFIG_DIR = PACKAGE.parent / "conf" if (PACKAGE.parent / "recipes").is_dir() else PACKAGE / "conf"
GROUPS = ("recipe", "model", "data")
# The exit codes of the jobs of one command line (a run: one; a sweep: one per job in this
# process), set by run_command_line for the Hydra task it calls.
_JOB_CODES: ContextVar[list[int]] = ContextVar("surgery_job_codes")


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
            roots.append(Path(str(entry)[len("file://") :]))
    return roots


# The library's errors name Python arguments; on the command line they are these overrides.
CLI_NAMES = {"pass overwrite=True": "pass output.overwrite=true"}


def fail(message: str) -> int:
    for python, override in CLI_NAMES.items():
        message = message.replace(python, override)
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
        if not overrides[-1].key_or_group.lstrip("+~"):
            return fail(f"cannot parse override {argument!r}: the key before '=' is empty (write KEY=VALUE)")
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


def _job_codes() -> list[int]:
    """The job codes of this command line; in a launcher's worker process (joblib, submitit),
    which reports through its sweep record instead, a list nobody reads. The task reaches the
    context variable through this module-level function: a launcher pickles the task by value,
    and a ContextVar cannot be pickled."""
    codes = _JOB_CODES.get(None)
    return [] if codes is None else codes


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def _task(cfg: DictConfig) -> float | None:
    """One job; returns its ``objective`` score (for a search sweeper) when the config has one."""
    codes = _job_codes()
    codes.append(-1)  # marks that composition succeeded and the job started
    hydra_config = HydraConfig.get()
    out_dir = Path(hydra_config.runtime.output_dir)
    if hydra_config.mode != RunMode.MULTIRUN:
        codes[-1], _, score = _run_job(cfg, out_dir)
        return score
    sweep_dir = Path(hydra_config.sweep.dir)
    overrides = dict(o.split("=", 1) for o in hydra_config.overrides.task if "=" in o)
    record = JobRecord(int(hydra_config.job.num), overrides, str(out_dir.resolve()), "started")
    record_job(sweep_dir, record)
    score = None
    try:
        code, dry_run, score = _run_job(cfg, out_dir, record)
        record.status = "dry_run" if dry_run else {EXIT_OK: "ok", EXIT_BAD_INPUT: "bad_input"}.get(code, "check_failed")
    except Exception as err:  # a job of a sweep never takes the sweep down: it is recorded as crashed
        traceback.print_exc()
        record.status, record.error, code = "crashed", f"{type(err).__name__}: {err}".splitlines()[0], 1
        score = _worst_score(cfg)
    record.objective = score
    record_job(sweep_dir, record)
    codes[-1] = code
    return score


def _run_job(cfg: DictConfig, out_dir: Path, record: JobRecord | None = None) -> tuple[int, bool, float | None]:
    """One run: (exit code: 0 ok, 1 a check failed, 2 bad configuration or input; whether it was
    a ``select_only`` dry run, which writes nothing; its objective score, when the config has an
    ``objective``). A bad input's one line also goes into ``record`` (a sweep job's), so the
    sweep summary says why; it scores the worst, so a search goes on."""
    try:
        config = load_config(cfg)
        if config.select_only:
            print(preview(config))
            return EXIT_OK, True, None
        result = run(config, out_dir)
        score = objective_value(config.objective, result.report) if config.objective else None
        if score is not None:
            print(f"  objective: {score:.6g}")
        return result.exit_code, False, score
    except SurgeryError as err:
        if record is not None:
            record.error = str(err).splitlines()[0]
        return fail(str(err).splitlines()[0]), False, _worst_score(cfg)


def _worst_score(cfg: DictConfig) -> float | None:
    """The score of a job that produced no report, when the sweep searches an objective."""
    objective = cfg.get("objective") if isinstance(cfg, DictConfig) else None
    if not objective:
        return None
    return -WORST if objective.get("maximize") is not None else WORST


def main() -> None:
    """Entry point of ``python -m surgery`` and the ``surgery`` console script."""
    sys.exit(run_command_line(sys.argv[1:]))


def run_command_line(arguments: list[str]) -> int:
    """Run ``python -m surgery ARGUMENTS`` (Hydra reads them from ``sys.argv``); return the exit
    code: 0 ok, 1 a check failed, 2 bad input, 128 + signal when interrupted."""
    code = preflight(arguments)
    if code:
        return code
    quiet_pytree_deprecations()
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # let composition errors reach us, unprinted
    multirun = any(a in ("-m", "--multirun") for a in arguments)
    codes: list[int] = []
    token = _JOB_CODES.set(codes)
    forget_sweep()  # an earlier command line's sweep in this process (a notebook, a test) is not this one's
    try:
        with taken_at_safe_points(), warnings.catch_warnings():  # signals raise between steps, never in a __del__
            # a recipe's deprecated spelling is said once, as a script's would be (Python hides them outside __main__)
            warnings.filterwarnings("default", category=DeprecationWarning, module=r"surgery(\.|$)")
            _task()
            raise_pending()
    except BaseException as err:  # noqa: BLE001 - each kind is answered in _exit_code below, or re-raised
        return _exit_code(err, started=bool(codes), multirun=multirun, codes=codes)
    finally:
        _JOB_CODES.reset(token)
    return _final_code(codes, multirun, launcher_error=None)


def _exit_code(err: BaseException, *, started: bool, multirun: bool, codes: list[int]) -> int:
    """The exit code for what stopped the Hydra task: one line each, decided here and only here.
    An error after a job started that is not ours is re-raised with its traceback."""
    if isinstance(err, Terminated):
        return _interrupted("terminated (SIGTERM)", 128 + signal.SIGTERM, err)
    if isinstance(err, KeyboardInterrupt):
        return _interrupted("interrupted", 128 + signal.SIGINT, err)
    if isinstance(err, (HydraException, OmegaConfBaseException)) and not started:
        lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line.startswith(" ")]
        return fail(" ".join(lines[:3]) or type(err).__name__)
    if isinstance(err, yaml.YAMLError) and not started:  # a user's config file that is not valid YAML
        mark = getattr(err, "problem_mark", None)
        where = f"{mark.name}, line {mark.line + 1}" if mark is not None else "a config file"
        return fail(f"{where}: not valid YAML ({getattr(err, 'problem', None) or type(err).__name__})")
    if isinstance(err, OSError) and not started:
        field = "hydra.sweep.dir" if multirun else "hydra.run.dir"
        return fail(f"{field}={str(err.filename or '')!r}: cannot hold the run's outputs ({err.strerror or err})")
    if isinstance(err, Exception) and multirun and current_sweep() is not None:  # a launcher process died
        launcher_error = " ".join(f"{type(err).__name__}: {err}".split())[:500]
        print(f"surgery: error: the sweep's launcher failed: {launcher_error}", file=sys.stderr)
        return _final_code(codes, multirun, launcher_error)
    raise err


def _final_code(codes: list[int], multirun: bool, launcher_error: str | None) -> int:
    """The worst of the jobs' codes; for a sweep, with the summary's."""
    if multirun and current_sweep() is None:
        codes.append(
            fail(
                "hydra.callbacks: surgery's sweep_records callback did not run, so the outcome of "
                "jobs in other processes is unknown; keep it in hydra.callbacks"
            )
        )
    elif multirun:
        codes.append(_finish_sweep(launcher_error))
    return max(codes, default=0)


def _finish_sweep(launcher_error: str | None) -> int:
    try:
        code, files, records = finish_sweep(launcher_error)
    except SurgeryError as err:
        return fail(str(err).splitlines()[0])
    failed = [r for r in records if r.exit_code]
    if files:
        print(
            f"sweep summary: {', '.join(str(f) for f in files)}"
            f"{f' ({len(failed)} of {len(records)} jobs failed)' if failed else ''}"
        )
    return code


def _interrupted(what: str, code: int, err: KeyboardInterrupt) -> int:
    published = getattr(err, "published", None)
    if published:
        print(
            f"surgery: {what} after its outputs were published: {', '.join(str(p) for p in published)} are complete",
            file=sys.stderr,
        )
    else:
        print(f"surgery: {what}; the run's outputs were left as they were", file=sys.stderr)
    return code
