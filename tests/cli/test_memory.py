"""Evaluation and calibration batches are streamed: a run's peak memory does not grow with
``data.batches`` (before, every batch was built up front and kept)."""

from __future__ import annotations

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


def run_peak(memory_probe, batches: int, folder: Path) -> float:
    """The peak of one run beyond the probe process before it, in MiB (this folder importable,
    for the model factory)."""
    overrides = [*RUN, f"data.batches={batches}", f"quantize.calibration_batches={batches}", f"hydra.run.dir={folder}"]
    return memory_probe.peak("cli", str(HERE), *overrides)


@pytest.mark.slow
@pytest.mark.xdist_group("memory")
def test_peak_memory_does_not_grow_with_the_number_of_batches(tmp_path, memory_probe):
    """One run first, so that the two measured start alike (Hydra and the app imported, the
    allocator warm); then 4 batches and 60. Kept batches would add ~240 MiB (measured: 935 MiB
    against 694 for whole processes, with every synthetic batch made up front and kept); the
    bound leaves room for allocator noise only."""
    run_peak(memory_probe, 1, tmp_path / "warm")
    few, many = run_peak(memory_probe, 4, tmp_path / "few"), run_peak(memory_probe, 60, tmp_path / "many")
    assert many < few + 64, f"peak {few:.0f} MiB beyond the process with 4 batches, {many:.0f} MiB with 60"


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
