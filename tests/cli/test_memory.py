"""Evaluation and calibration batches are streamed: a run's peak memory does not grow with
``data.batches`` (before, every batch was built up front and kept)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# mobilenet_v3_small does little work per input byte: a 4x3x96x96 batch is 432 KiB, so 400
# batches kept would add 169 MiB (and calibration as much again); two output classes keep the
# per-batch outputs small.
RUN = [
    "recipe=prune_quantize_resnet50",
    "model.name=mobilenet_v3_small",
    "model.num_classes=2",
    "data.image_size=96",
    "data.batch_size=4",
    "checks.per_layer=false",
    "output.plots=false",
]


def peak_rss_mib(batches: int, folder: Path) -> float:
    """Peak resident memory of one run (its own process) in MiB."""
    process = subprocess.Popen(
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
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    _, status, usage = os.wait4(process.pid, 0)
    assert os.waitstatus_to_exitcode(status) in (0, 1), process.stderr.read().decode()[-2000:]
    process.stderr.close()
    return usage.ru_maxrss / 1024  # KiB on Linux


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_number_of_batches(tmp_path):
    few = peak_rss_mib(4, tmp_path / "few")
    many = peak_rss_mib(400, tmp_path / "many")
    # Kept batches would add ~340 MiB (evaluation + calibration) to a ~700 MiB process; the bound
    # leaves room for allocator noise only.
    assert many < 1.10 * few, f"peak RSS {few:.0f} MiB with 4 batches, {many:.0f} MiB with 400"


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
