"""Tests of surgery.tasks.digits: the seeded digits split, accuracy, training and the shipped CNN."""

from __future__ import annotations

import runpy
import sys
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import Tensor, nn

import surgery
from surgery.analysis.metrics import accuracy
from surgery.core.checkpoints import load_checkpoint
from surgery.core.errors import ConfigError
from surgery.tasks import digits
from surgery.tasks.digits import CHECKPOINT, DigitsCNN, digits_batches, digits_split, train

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_digits_cnn.py"
MIN_ACCURACY = 0.95


@pytest.fixture(scope="module")
def shipped() -> DigitsCNN:
    return load_checkpoint(DigitsCNN(), CHECKPOINT).eval()


@pytest.fixture(scope="module")
def shipped_accuracy(shipped: DigitsCNN) -> float:
    return accuracy(shipped, digits_batches("test", 256))


def rows(images: Tensor, labels: Tensor) -> Counter:
    """The samples as a multiset of (pixels, label)."""
    return Counter((tuple(image.flatten().tolist()), int(label)) for image, label in zip(images, labels, strict=True))


@pytest.mark.parametrize("split, size", [("train", 1438), ("test", 359)])
def test_split_shapes_dtypes_and_ranges(split: str, size: int) -> None:
    images, labels = digits_split(split)
    assert images.shape == (size, 1, 8, 8) and images.dtype == torch.float32
    assert labels.shape == (size,) and labels.dtype == torch.int64
    assert images.min() == 0.0 and images.max() == 1.0
    assert set(labels.tolist()) == set(range(10))


def test_train_and_test_partition_the_data_set_stratified() -> None:
    train_images, train_labels = digits_split("train")
    test_images, test_labels = digits_split("test")
    train_rows, test_rows = rows(train_images, train_labels), rows(test_images, test_labels)
    assert not train_rows & test_rows  # the data set holds no duplicate image, so none is shared
    assert train_rows + test_rows == rows(*digits._load_digits())  # and none is lost
    counts = test_labels.bincount(minlength=10) + train_labels.bincount(minlength=10)
    test_share = test_labels.bincount(minlength=10) / counts
    assert torch.all((test_share - 0.2).abs() < 0.01), test_share


def test_split_is_deterministic_per_seed() -> None:
    for split in ("train", "test"):
        first, second = digits_split(split, seed=0), digits_split(split, seed=0)
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(digits_split("test", seed=0)[0], digits_split("test", seed=1)[0])


def test_split_does_not_touch_global_random_state() -> None:
    state = torch.get_rng_state()
    digits_split("train", seed=3)
    assert torch.equal(torch.get_rng_state(), state)


def test_bad_split_is_a_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="train, test") as info:
        digits_split("validation")
    assert info.value.field == "data.split" and info.value.value == "validation"


def test_missing_scikit_learn_says_how_to_install_it() -> None:
    digits._load_digits.cache_clear()
    try:
        with mock.patch.dict(sys.modules, {"sklearn": None, "sklearn.datasets": None}):
            with pytest.raises(ConfigError, match="pip install scikit-learn"):
                digits_split("train")
    finally:
        digits._load_digits.cache_clear()


def test_batches_are_fixed_in_order_and_limited() -> None:
    images, labels = digits_split("test")
    batches = digits_batches("test", 100)
    assert [len(b[1]) for b in batches] == [100, 100, 100, 59]
    assert torch.equal(torch.cat([b[0] for b in batches]), images)
    assert torch.equal(torch.cat([b[1] for b in batches]), labels)
    limited = digits_batches("test", 100, limit_batches=2)
    assert len(limited) == 2 and torch.equal(limited[1][0], batches[1][0])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"batch_size": 0}, "data.batch_size"),
        ({"batch_size": 8, "limit_batches": 0}, "data.limit_batches"),
    ],
)
def test_bad_batching_is_a_config_error(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        digits_batches("test", **kwargs)
    assert info.value.field == field


def test_model_has_the_layers_surgery_targets() -> None:
    kinds = {type(m) for m in DigitsCNN().modules()}
    assert {nn.Conv2d, nn.BatchNorm2d, nn.Linear} <= kinds
    assert DigitsCNN(num_classes=4)(torch.zeros(2, 1, 8, 8)).shape == (2, 4)


def test_checkpoint_ships_inside_the_package() -> None:
    assert CHECKPOINT.is_file()
    assert CHECKPOINT.is_relative_to(Path(surgery.__file__).resolve().parent)


def test_shipped_checkpoint_loads_strictly_and_is_accurate(shipped: DigitsCNN, shipped_accuracy: float) -> None:
    state = shipped.state_dict()
    DigitsCNN().load_state_dict(state, strict=True)
    assert any(k.endswith("running_var") for k in state)  # batch-norm statistics were saved
    assert shipped_accuracy >= MIN_ACCURACY


def test_accuracy_restores_training_flags_and_batch_norm_statistics(shipped: DigitsCNN) -> None:
    model = DigitsCNN()
    model.load_state_dict(shipped.state_dict())
    model.train()
    model.bn2.eval()
    flags = {name: m.training for name, m in model.named_modules()}
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    value = accuracy(model, digits_batches("test", 128, limit_batches=1))
    assert 0.0 <= value <= 1.0
    assert {name: m.training for name, m in model.named_modules()} == flags
    assert all(torch.equal(v, stats[k]) for k, v in model.state_dict().items())


def test_accuracy_of_no_sample_is_an_error() -> None:
    with pytest.raises(ValueError, match="no sample"):
        accuracy(DigitsCNN(), [])


def test_training_reproduces_the_shipped_checkpoint(shipped_accuracy: float) -> None:
    # Bit-identity is not asserted: float summation order differs across CPUs, kernels and
    # torch versions, so retrained weights may differ in the last bits from the shipped ones.
    # The promise is the accuracy: within one point of the shipped checkpoint's.
    threads, state = torch.get_num_threads(), torch.get_rng_state()
    model = train()
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), state)
    assert not model.training
    assert abs(accuracy(model, digits_batches("test", 256)) - shipped_accuracy) <= 0.01


def test_bad_training_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="train.epochs"):
        train(epochs=0)
    with pytest.raises(ConfigError, match="train.lr"):
        train(lr=0.0)


def test_script_writes_a_checkpoint_that_loads_strictly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "digits.safetensors"
    argv = [str(SCRIPT), "--out", str(out), "--epochs", "1"]
    with mock.patch.object(sys, "argv", argv):  # in-process: a subprocess re-imports torch
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert "test accuracy" in capsys.readouterr().out
    model = load_checkpoint(DigitsCNN(), out)
    assert accuracy(model, digits_batches("test", 256)) > 0.5  # one epoch already learns
