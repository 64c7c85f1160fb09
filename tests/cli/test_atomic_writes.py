"""Atomic writes: every output of a run (report.json, report.md, sparsity.png, drift.png, the
checkpoint as .safetensors or .pt, model.qparams.safetensors) and of a sweep summary
(sweep.json, sweep.md, sweep.png) goes to a temporary name, is flushed and renamed; a write
that fails half-way (an error or an interrupt) leaves neither a partial file nor a temporary,
and an existing output is never overwritten silently."""

from __future__ import annotations

import io
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import pytest
import safetensors.torch
import torch
from matplotlib.figure import Figure
from support import dead_pid, exit_code_of_a_child  # tests/support.py

from surgery.cli import run as run_module
from surgery.cli import sweeps
from surgery.cli.config_loading import load_config
from surgery.cli.reporting import write_reports
from surgery.core import checkpoints
from surgery.core.checkpoints import load_checkpoint, save_checkpoint, save_tensors, write_atomically
from surgery.core.errors import ConfigError, OutputExistsError
from surgery.tasks.digits import DigitsCNN

ERRORS = [OSError, KeyboardInterrupt]
PREVIOUS = b"the previous version\n"


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models: one intra-op thread avoids thread spin-up costs; put back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- writers that write half of the real bytes, then fail ---------------------------------------


def half_then_fail(target: str, error: type[BaseException], render: Callable[..., bytes], real: Callable):
    """A stand-in for a writer ``real(obj, destination, ...)``: for the temporary file of
    ``target`` it writes half of the bytes ``render`` produces, then raises ``error``; other
    files are written for real."""

    def writer(obj, destination, *args, **kwargs):
        destination = Path(destination)
        if not destination.name.startswith(f".{target}."):
            return real(obj, destination, *args, **kwargs)
        data = render(obj, *args, **kwargs)
        with open(destination, "wb") as handle:
            handle.write(data[: len(data) // 2])
        raise error(f"interrupted while writing {target}")

    return writer


def _png(figure: Figure, *args, **kwargs) -> bytes:
    buffer = io.BytesIO()
    REAL_SAVEFIG(figure, buffer, **{k: v for k, v in kwargs.items() if k != "format"}, format="png")
    return buffer.getvalue()


def _torch_bytes(obj, *args, **kwargs) -> bytes:
    buffer = io.BytesIO()
    REAL_TORCH_SAVE(obj, buffer)
    return buffer.getvalue()


REAL_SAVEFIG, REAL_TORCH_SAVE, REAL_WRITE_TEXT = Figure.savefig, torch.save, Path.write_text


def failing_writer(target: str, error: type[BaseException]):
    """``mock.patch`` of the library call that writes ``target``, failing half-way through it."""
    if target.endswith(".png"):
        return mock.patch.object(Figure, "savefig", half_then_fail(target, error, _png, REAL_SAVEFIG))
    if target.endswith(".safetensors"):

        def render(tensors, metadata=None):
            return safetensors.torch.save(tensors, metadata=metadata)

        real = checkpoints.save_file
        return mock.patch.object(checkpoints, "save_file", half_then_fail(target, error, render, real))
    if target.endswith(".pt"):
        return mock.patch.object(
            checkpoints.torch, "save", half_then_fail(target, error, _torch_bytes, REAL_TORCH_SAVE)
        )

    def write_text(path: Path, text: str, *args, **kwargs):  # Path.write_text(self, data): the path comes first
        if not path.name.startswith(f".{target}."):
            return REAL_WRITE_TEXT(path, text, *args, **kwargs)
        data = text.encode()
        with open(path, "wb") as handle:
            handle.write(data[: len(data) // 2])
        raise error(f"interrupted while writing {target}")

    return mock.patch.object(Path, "write_text", write_text)


def listing(folder: Path) -> dict[str, bytes]:
    """Every file and folder below ``folder`` (hidden ones too), with the files' bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(folder.rglob("*"))}


# --- each output on its own ---------------------------------------------------------------------


REPORT = {
    "recipe": "atomic",
    "model": "tiny",
    "ok": True,
    "params": {"total": 10, "nonzero": 5},
    "sparsity": 0.5,
    "checks": [{"name": "drift", "passed": True, "value": 0.9, "threshold": 0.5, "detail": ""}],
    "drift": {"max_abs": 1.0, "cosine": 0.9, "sqnr_db": 10.0, "top1_agreement": 1.0},
    "layers": [
        {"name": name, "type": "Conv2d", "sparsity": 0.5, "cosine": 0.9, "sqnr_db": 10.0, "max_abs": 1.0}
        for name in ("conv1", "conv2", "fc")
    ],
    "timings_s": {"build": 0.1, "surgery": 0.1, "checks": 0.1},
}


def write_one(target: str, folder: Path) -> None:
    """Write ``target`` into ``folder`` the way the toolkit does."""
    model = DigitsCNN()
    if target.startswith("model.qparams"):
        save_tensors({"fc1.scale": torch.tensor(0.5), "fc1.zero_point": torch.tensor(3)}, folder / target)
    elif target.startswith("model."):
        save_checkpoint(model, folder / target, overwrite=True)
    elif target.startswith("report.") or target in ("sparsity.png", "drift.png"):
        write_reports(REPORT, folder, plots=target.endswith(".png"))
    else:
        sweeps.write_sweep_summary(folder, sweep_jobs(folder), overwrite=True)


def sweep_jobs(folder: Path) -> list[sweeps.JobRecord]:
    jobs = []
    for index, amount in enumerate(("0.3", "0.6")):
        job = folder / str(index)
        job.mkdir(exist_ok=True)
        (job / "report.json").write_text(json.dumps({**REPORT, "sparsity": float(amount)}))
        jobs.append(sweeps.JobRecord(index, {"prune.amount": amount}, str(job), "ok"))
    return jobs


RUN_OUTPUTS = [
    "report.json",
    "report.md",
    "sparsity.png",
    "drift.png",
    "model.safetensors",
    "model.pt",
    "model.qparams.safetensors",
]
SWEEP_OUTPUTS = ["sweep.json", "sweep.md", "sweep.png"]


@pytest.mark.parametrize("previous", [False, True], ids=["new", "replacing"])
@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("target", RUN_OUTPUTS + SWEEP_OUTPUTS)
def test_a_write_failing_half_way_leaves_no_partial_file_and_no_temporary(tmp_path, target, error, previous):
    if previous:
        (tmp_path / target).write_bytes(PREVIOUS)
    with failing_writer(target, error), pytest.raises(error, match="interrupted"):
        write_one(target, tmp_path)
    if previous:
        assert (tmp_path / target).read_bytes() == PREVIOUS
    else:
        assert not (tmp_path / target).exists()
    leftovers = [name for name in listing(tmp_path) if Path(name).name.startswith(".")]
    assert leftovers == [], "a temporary file or staging folder was left behind"
    if target in SWEEP_OUTPUTS:  # the summary is published together: none of it, or all of it
        assert all((tmp_path / name).exists() == (previous and name == target) for name in SWEEP_OUTPUTS)
    write_one(target, tmp_path)  # the same write, without the failure, succeeds and replaces it
    assert (tmp_path / target).read_bytes() not in (PREVIOUS, b"")


def test_data_is_flushed_to_disk_before_the_rename_and_the_folder_after(tmp_path):
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor):
        status = os.fstat(descriptor)
        events.append("fsync folder" if stat.S_ISDIR(status.st_mode) else f"fsync file of {status.st_size} bytes")
        real_fsync(descriptor)

    def replace(source, destination):
        events.append(f"replace {Path(destination).name}")
        real_replace(source, destination)

    with mock.patch.object(checkpoints.os, "fsync", fsync), mock.patch.object(checkpoints.os, "replace", replace):
        write_atomically(tmp_path / "out.txt", lambda tmp: tmp.write_text("payload"))
    assert events == ["fsync file of 7 bytes", "replace out.txt", "fsync folder"]
    assert (tmp_path / "out.txt").read_text() == "payload"
    assert oct((tmp_path / "out.txt").stat().st_mode & 0o777) == "0o644"


@pytest.mark.parametrize("error", ERRORS)
def test_an_interrupt_at_the_rename_keeps_the_previous_version(tmp_path, error):
    (tmp_path / "out.txt").write_bytes(PREVIOUS)
    with mock.patch.object(checkpoints.os, "replace", side_effect=error("interrupted at the rename")):
        with pytest.raises(error, match="interrupted"):
            write_atomically(tmp_path / "out.txt", lambda tmp: tmp.write_text("new"))
    assert listing(tmp_path) == {"out.txt": PREVIOUS}


# --- a whole run ----------------------------------------------------------------------------------


def pipeline_config(**output):
    return load_config(
        {
            "recipe": "atomic",
            "model": {"source": "digits_cnn", "name": "digits_cnn", "weights": None, "num_classes": 10},
            "data": {"kind": "synthetic", "batch_size": 2, "batches": 1, "channels": 1, "image_size": 8},
            "steps": ["prune", "quantize"],
            "prune": {"amount": 0.5},
            "quantize": {"activations": {"bits": 8}, "calibration_batches": 1},
            "output": {"plots": False, **output},
        }
    )


@pytest.mark.parametrize("checkpoint", ["safetensors", "pt"])
def test_a_run_interrupted_while_saving_the_checkpoint_leaves_nothing_and_reruns(tmp_path, checkpoint):
    config = pipeline_config(checkpoint=checkpoint)
    (tmp_path / "notes.txt").write_text("mine\n")
    before = listing(tmp_path)
    with failing_writer(f"model.{checkpoint}", KeyboardInterrupt), pytest.raises(KeyboardInterrupt):
        run_module.run(config, tmp_path, echo=False)
    assert listing(tmp_path) == before  # no half-written checkpoint, no temporary, no other output
    result = run_module.run(config, tmp_path, echo=False)
    assert result.exit_code == 0
    assert sorted(listing(tmp_path)) == sorted(
        ["notes.txt", "report.json", "report.md", f"model.{checkpoint}", "model.qparams.safetensors"]
    )
    assert json.loads((tmp_path / "report.json").read_text())["checkpoint"] == f"model.{checkpoint}"
    load_checkpoint(DigitsCNN(), tmp_path / f"model.{checkpoint}")


def test_a_run_into_a_new_folder_that_fails_does_not_leave_the_folder(tmp_path):
    with (
        mock.patch.object(run_module, "write_reports", side_effect=OSError("disk full")),
        pytest.raises(ConfigError, match="output=.*cannot be written \\(disk full\\); nothing was written"),
    ):
        run_module.run(pipeline_config(), tmp_path / "new" / "run", echo=False)
    assert listing(tmp_path) == {"new": b"<dir>"}


@pytest.mark.parametrize("existing", RUN_OUTPUTS)
def test_a_run_refuses_any_existing_output_before_doing_anything(tmp_path, existing):
    checkpoint = "pt" if existing == "model.pt" else "safetensors"
    config = pipeline_config(plots=True, checkpoint=checkpoint)
    assert existing in run_module.run_outputs()
    (tmp_path / existing).write_bytes(PREVIOUS)
    with (
        mock.patch.object(run_module, "_build", side_effect=AssertionError("the run started")),
        pytest.raises(OutputExistsError, match=f"{existing}.*already exists.*overwrite"),
    ):
        run_module.run(config, tmp_path, echo=False)
    assert listing(tmp_path) == {existing: PREVIOUS}


def test_overwrite_replaces_the_previous_outputs_and_removes_stale_ones(tmp_path):
    for name in ("report.json", "model.qparams.safetensors", "sparsity.png", "unrelated.txt"):
        (tmp_path / name).write_bytes(PREVIOUS)
    config = load_config(
        {
            "recipe": "atomic",
            "model": {"source": "digits_cnn", "name": "digits_cnn", "weights": None, "num_classes": 10},
            "data": {"kind": "synthetic", "batch_size": 2, "batches": 1, "channels": 1, "image_size": 8},
            "steps": ["quantize"],
            "quantize": {"activations": None},
            "checks": {"per_layer": False},
            "output": {"plots": True, "overwrite": True},
        }
    )
    result = run_module.run(config, tmp_path, echo=False)
    assert result.exit_code == 0
    files = listing(tmp_path)
    assert sorted(files) == ["model.safetensors", "report.json", "report.md", "unrelated.txt"]
    assert files["unrelated.txt"] == PREVIOUS  # not an output of a run: left alone
    assert json.loads(files["report.json"])["qparams"] is None


# --- a sweep summary ------------------------------------------------------------------------------


@pytest.mark.parametrize("existing", SWEEP_OUTPUTS)
def test_a_sweep_summary_refuses_an_existing_file_and_writes_nothing(tmp_path, existing):
    jobs = sweep_jobs(tmp_path)
    (tmp_path / existing).write_bytes(PREVIOUS)
    before = listing(tmp_path)
    with pytest.raises(OutputExistsError, match=f"{existing}.*already exists"):
        sweeps.write_sweep_summary(tmp_path, jobs)
    assert listing(tmp_path) == before
    overwriting = [
        sweeps.JobRecord(job.num, {**job.overrides, "output.overwrite": "true"}, job.folder, job.status) for job in jobs
    ]
    written = sweeps.write_sweep_summary(tmp_path, overwriting)  # asked for on the command line
    assert [p.name for p in written] == SWEEP_OUTPUTS
    assert (tmp_path / existing).read_bytes() != PREVIOUS


# --- publishing a set: all-old or all-new -----------------------------------------------------


def stage_set(folder: Path, names: list[str]) -> checkpoints.Staging:
    stage = checkpoints.Staging(folder).__enter__()
    for name in names:
        (stage / name).write_bytes(b"new " + name.encode())
    return stage


@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("fail_at", range(5))
def test_a_publish_failing_at_any_rename_leaves_the_whole_earlier_set(tmp_path, error, fail_at):
    earlier = {"report.json": PREVIOUS, "model.safetensors": PREVIOUS, "drift.png": PREVIOUS}
    for name, data in earlier.items():
        (tmp_path / name).write_bytes(data)
    stage = stage_set(tmp_path, ["report.json", "model.pt", "report.md"])
    real_replace, calls = os.replace, []

    def replace(source, destination):
        calls.append(Path(destination).name)
        if len(calls) == fail_at + 1:
            raise error("interrupted at a rename")
        real_replace(source, destination)

    with mock.patch.object(checkpoints.os, "replace", replace), pytest.raises(error, match="interrupted"):
        stage.publish(overwrite=True, last="report.json", replaces=run_module.run_outputs())
    stage.__exit__(None, None, None)
    assert listing(tmp_path) == earlier  # not one new file, not one earlier file missing, nothing hidden


def test_overwrite_removes_an_earlier_runs_outputs_of_another_format(tmp_path):
    """An earlier run wrote model.safetensors and plots; this one writes model.pt and no plots."""
    for name in ("report.json", "report.md", "model.safetensors", "sparsity.png", "drift.png", "notes.txt"):
        (tmp_path / name).write_bytes(PREVIOUS)
    stage = stage_set(tmp_path, ["report.json", "report.md", "model.pt"])
    stage.publish(overwrite=True, last="report.json", replaces=run_module.run_outputs())
    stage.__exit__(None, None, None)
    assert sorted(listing(tmp_path)) == ["model.pt", "notes.txt", "report.json", "report.md"]


def test_the_earlier_report_is_moved_aside_first_and_the_new_one_published_last(tmp_path):
    for name in ("model.safetensors", "report.json"):
        (tmp_path / name).write_bytes(PREVIOUS)
    stage = stage_set(tmp_path, ["report.json", "model.safetensors", "report.md"])
    real_replace, moves = os.replace, []
    with mock.patch.object(
        checkpoints.os,
        "replace",
        lambda s, d: (moves.append((Path(s).parent == tmp_path, Path(d).name)), real_replace(s, d)),
    ):
        stage.publish(overwrite=True, last="report.json", replaces=run_module.run_outputs())
    stage.__exit__(None, None, None)
    moves = [move for move in moves if move[1] != checkpoints.MANIFEST]  # written first, into the backup
    assert moves[0] == (True, "report.json") and moves[-1] == (False, "report.json")


def test_a_dangling_symlink_at_an_output_name_is_an_existing_output(tmp_path):
    (tmp_path / "report.json").symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(OutputExistsError, match="report.json"):
        run_module.run(pipeline_config(), tmp_path, echo=False)
    assert (tmp_path / "report.json").is_symlink() and not (tmp_path / "nowhere.json").exists()


def test_staging_folders_of_dead_processes_on_this_host_are_swept_and_live_ones_kept(tmp_path):
    import socket

    dead, host = dead_pid(), socket.gethostname()
    stale = tmp_path / f".staging-{host}-{dead}-abc123"
    stale_backup = tmp_path / f".previous-{host}-{dead}-abc123"
    live = tmp_path / f".staging-{host}-{os.getpid()}-def456"
    other_host = tmp_path / f".staging-elsewhere-{dead}-ghi789"
    for folder in (stale, stale_backup, live, other_host):
        folder.mkdir()
        (folder / "model.safetensors.tmp").write_bytes(b"x" * 1000)
    with checkpoints.Staging(tmp_path):
        pass
    assert not stale.exists() and not stale_backup.exists()
    assert live.exists() and other_host.exists()  # a running process, or another host's run on a shared disk


def publish_and_die(folder: Path, die_at: int) -> None:
    """Publish three new outputs over an earlier run's and be killed outright at the
    ``die_at``-th rename (run in a forked child: exit code 9)."""
    stage = checkpoints.Staging(folder).__enter__()
    for name in ("report.json", "model.pt", "report.md"):
        (stage / name).write_bytes(b"new " + name.encode())
    real, calls = os.replace, []

    def replace(source, destination):
        calls.append(destination)
        if len(calls) == die_at:
            os._exit(9)  # killed outright: no cleanup runs
        real(source, destination)

    checkpoints.os.replace = replace
    stage.publish(
        overwrite=True,
        last="report.json",
        replaces=("report.json", "report.md", "model.safetensors", "model.pt", "drift.png"),
    )


@pytest.mark.parametrize("die_at", range(2, 8))  # the first rename is the manifest's
def test_a_run_killed_while_publishing_is_undone_by_the_next_one(tmp_path, die_at):
    earlier = {"report.json": PREVIOUS, "model.safetensors": PREVIOUS, "drift.png": PREVIOUS}
    for name, data in earlier.items():
        (tmp_path / name).write_bytes(data)
    assert exit_code_of_a_child(lambda: publish_and_die(tmp_path, die_at)) == 9
    with checkpoints.Staging(tmp_path):
        pass
    assert listing(tmp_path) == earlier  # the whole earlier set, nothing new, nothing hidden


def test_publishing_without_overwrite_never_removes_the_files_it_would_replace(tmp_path):
    (tmp_path / "drift.png").write_bytes(PREVIOUS)
    stage = stage_set(tmp_path, ["report.json"])
    stage.publish(overwrite=False, last="report.json", replaces=run_module.run_outputs())
    stage.__exit__(None, None, None)
    assert listing(tmp_path)["drift.png"] == PREVIOUS


def test_a_planted_manifest_entry_outside_the_folder_is_ignored_with_a_warning(tmp_path, caplog):
    """Before: a `.previous-*/MANIFEST.json` naming "../../victim.txt" made the next run delete that file."""
    import socket

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "a" / "b"
    backup = out / f".previous-{socket.gethostname()}-{dead_pid()}-abc123"
    backup.mkdir(parents=True)
    (out / "report.json").write_bytes(b"new")
    (backup / "report.json").write_bytes(PREVIOUS)
    (backup / "MANIFEST.json").write_text(
        json.dumps(
            {
                "moved_aside": ["report.json", "../../victim.txt", "/etc/x"],
                "publishing": ["../../victim.txt", "report.json", 3],
            }
        )
    )
    with caplog.at_level("WARNING", logger="surgery"), checkpoints.Staging(out):
        pass
    assert victim.read_text() == "keep me"
    assert listing(out) == {"report.json": PREVIOUS}  # the plain name is still put back
    assert "ignored '../../victim.txt'" in caplog.text and "ignored 3" in caplog.text


def test_a_second_claim_on_an_output_folder_is_refused_until_the_first_ends(tmp_path):
    from surgery.core.errors import OutputBusyError
    from surgery.core.folders import claimed

    folder = tmp_path / "new"
    with claimed(folder):
        with pytest.raises(OutputBusyError, match=r"^output='.*new': another run is writing into this folder now"):
            with claimed(folder):
                pass
    assert not folder.exists()  # created by the claim, removed with it
    with claimed(folder):  # free again
        pass


def test_an_interrupt_during_publishing_takes_effect_after_it_and_leaves_nothing_hidden(tmp_path, default_sigint):
    """Before: SIGINT at the end of an overwriting publish left the new set in place, an empty
    `.previous-*` folder behind, and the CLI said the outputs were left as they were."""
    import signal

    from surgery.cli.app import _interrupted

    earlier = {"report.json": PREVIOUS, "model.safetensors": PREVIOUS}
    for name, data in earlier.items():
        (tmp_path / name).write_bytes(data)
    stage = stage_set(tmp_path, ["report.json", "model.safetensors"])
    real = os.replace

    def replace(source, destination):
        real(source, destination)
        if Path(destination).name == "report.json" and Path(destination).parent == tmp_path:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C as the last file lands, on this (the main) thread

    with mock.patch.object(checkpoints.os, "replace", replace), pytest.raises(KeyboardInterrupt) as caught:
        stage.publish(overwrite=True, last="report.json")
    stage.__exit__(None, None, None)
    assert stage.published == [tmp_path / "model.safetensors", tmp_path / "report.json"]
    assert listing(tmp_path) == {"model.safetensors": b"new model.safetensors", "report.json": b"new report.json"}
    caught.value.published = stage.published
    with mock.patch("sys.stderr", new_callable=io.StringIO) as stderr:
        assert _interrupted("interrupted", 130, caught.value) == 130
    assert "after its outputs were published" in stderr.getvalue() and "left as they were" not in stderr.getvalue()


def test_an_earlier_runs_export_is_not_left_beside_a_new_report(tmp_path):
    (tmp_path / "export.pt").write_bytes(b"an earlier run's torchao export")
    with pytest.raises(OutputExistsError, match="export.pt"):
        run_module.run(pipeline_config(), tmp_path, echo=False)
    assert run_module.run(pipeline_config(overwrite=True), tmp_path, echo=False).exit_code == 0
    assert not (tmp_path / "export.pt").exists() and (tmp_path / "report.json").exists()
