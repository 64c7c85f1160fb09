"""Evaluation and calibration batches are streamed: a run's peak memory does not grow with
``data.batches`` (before, every batch was built up front and kept)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# A model that does almost no work per input byte (it averages 8x8 patches before its one
# convolution), so the run's time goes to the batches, not to the model: a 16x3x128x128 batch is
# 3 MiB, so 60 batches kept would add 180 MiB (and calibration as much again).
RUN = [
    "recipe=prune_quantize_resnet50",
    "model=factory",
    "model._target_=test_memory.pooled_cnn",
    "data.image_size=128",
    "data.batch_size=16",
    "checks.per_layer=false",
    "output.plots=false",
]


def pooled_cnn() -> nn.Module:
    """A tiny classifier whose first layer averages 8x8 patches: cheap per input byte."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.AvgPool2d(8), nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)
    )


def start_run(batches: int, folder: Path) -> subprocess.Popen:
    """Start one run in its own process (this folder importable, for the model factory)."""
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "surgery",
            *RUN,
            f"data.batches={batches}",
            f"quantize.calibration_batches={batches}",
            f"hydra.run.dir={folder}",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path},
    )


def peak_rss_mib(process: subprocess.Popen) -> float:
    """Peak resident memory of a started run's process in MiB, once it has ended."""
    _, status, usage = os.wait4(process.pid, 0)
    assert os.waitstatus_to_exitcode(status) in (0, 1), process.stderr.read().decode()[-2000:]
    process.stderr.close()
    return usage.ru_maxrss / 1024  # KiB on Linux


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_number_of_batches(tmp_path):
    # Both runs at once (each its own process, one thread each): peak RSS is per process.
    runs = start_run(4, tmp_path / "few"), start_run(60, tmp_path / "many")
    few, many = (peak_rss_mib(run) for run in runs)
    # Kept batches add ~240 MiB to a ~690 MiB process (measured: 935 MiB against 694 with every
    # synthetic batch made up front and kept); the bound leaves room for allocator noise only.
    assert many < 1.10 * few, f"peak RSS {few:.0f} MiB with 4 batches, {many:.0f} MiB with 60"


def test_image_folder_batches_are_read_when_used_not_held(tmp_path):
    """Before: every evaluation image was decoded into a list at load time, so peak memory grew
    by one batch per `data.batches` (4.3 MB a batch at 224 px)."""
    from unittest import mock

    from support import image_folder  # tests/support.py

    from surgery.cli import data as data_module
    from surgery.cli.config import DataConfig
    from surgery.tasks import image_folders

    root = image_folder(tmp_path / "images", ("a", "b"), 6, (40, 48), seed=0)
    config = DataConfig(kind="imagefolder", root=str(root), batch_size=2, batches=5, image_size=32)
    reads = []
    real = image_folders._image
    with mock.patch.object(image_folders, "_image", lambda folder, i: reads.append(i) or real(folder, i)):
        loaded = data_module.load_data(config)
        assert reads == []  # nothing decoded yet
        pairs = list(loaded.labelled())
        assert len(pairs) == 5 and len(reads) == 10  # each image once: inputs and labels come together
        assert [tuple(x.shape) for x in loaded.inputs[:1]] == [(2, 3, 32, 32)]
