"""Inputs for the checks: seeded synthetic images, or real labelled data (digits, MNIST-1D).

Batches are streamed: :class:`SyntheticBatches` makes each batch when it is reached and drops
it after use, so a run's memory does not grow with ``data.batches``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from surgery.cli.config import DataConfig
from surgery.cli.hf_folders import refuse_custom_code
from surgery.core.errors import NO_VALUE, ConfigError

log = logging.getLogger("surgery")


class SyntheticBatches(Sequence):
    """``count`` seeded Gaussian batches of ``shape``, made again on every pass (the same values
    each time), one at a time."""

    def __init__(self, shape: tuple[int, ...], seed: int, count: int) -> None:
        self.shape, self.seed, self.count = shape, seed, count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(self.count):
            yield torch.randn(self.shape, generator=generator)

    def __getitem__(self, index: int) -> Tensor:  # type: ignore[override]
        if not -self.count <= index < self.count:
            raise IndexError(index)
        for position, batch in enumerate(self):
            if position == index % self.count:
                return batch
        raise IndexError(index)


@dataclass
class Data:
    """Evaluation batches, with labels when the data set has them (for accuracy)."""

    inputs: Sequence[Tensor]
    labels: Sequence[Tensor] | None

    def labelled(self) -> Iterator[tuple[Tensor, Tensor]]:
        if isinstance(self.inputs, Column) and self.inputs.pairs is getattr(self.labels, "pairs", None):
            return iter(self.inputs.pairs)  # one read of each batch, not one for inputs and one for labels
        return zip(self.inputs, self.labels or [], strict=True)


class Column(Sequence):
    """One side (0: inputs, 1: labels) of a sequence of ``(inputs, labels)`` batches, read
    through: a lazily loaded data set stays lazy."""

    def __init__(self, pairs: Sequence[tuple[Tensor, Tensor]], side: int) -> None:
        self.pairs, self.side = pairs, side

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.pairs[index][self.side]


class ImageFolderBatches(Sequence):
    """Labelled batches of an ``ImageFolder``, each read from disk when it is asked for, so
    peak memory holds one batch whatever ``data.batches`` is."""

    def __init__(self, folder: Any, indices: list[int], batch_size: int) -> None:
        self.folder, self.indices, self.batch_size = folder, indices, batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        images = [_image(self.folder, i) for i in self.indices[index * self.batch_size : (index + 1) * self.batch_size]]
        return torch.stack([x for x, _ in images]), torch.tensor([y for _, y in images])


LabelledBatches = Callable[..., list[tuple[Tensor, Tensor]]]  # (split, batch_size, *, limit_batches)


def labelled_source(kind: str, config: DataConfig | None = None) -> LabelledBatches | None:
    """The batch function of a labelled data set (its fixed train/test split), or None."""
    if kind == "imagefolder" and config is not None:
        return lambda split, batch_size, limit_batches=None: image_folder_batches(
            config, split, batch_size, limit_batches
        )
    if kind == "digits":
        from surgery.cli.digits import digits_batches

        return digits_batches
    if kind == "mnist1d":
        from surgery.cli.mnist1d import mnist1d_batches

        return mnist1d_batches
    if kind == "tinylm":
        from surgery.cli.tinylm import token_batches

        return token_batches
    return None


def load_data(config: DataConfig) -> Data:
    """The evaluation batches of ``config``: ``config.batches`` batches of ``config.batch_size``."""
    source = labelled_source(config.kind, config)
    if source is not None:
        pairs = source("test", config.batch_size, limit_batches=config.batches)  # the fixed split
        return Data(Column(pairs, 0), Column(pairs, 1))
    if config.kind == "tokens":
        return Data(token_dicts(config, config.seed, config.batches), None)
    return Data(_noise(config, config.seed, config.batches), None)


def calibration_batches(config: DataConfig, count: int) -> Sequence[Tensor]:
    """``count`` batches for calibration, disjoint from the evaluation batches (labelled data:
    the training split; synthetic: noise from ``seed + 1``)."""
    source = labelled_source(config.kind, config)
    if source is not None:
        return Column(source("train", config.batch_size, limit_batches=count), 0)
    if config.kind == "tokens":
        return token_dicts(config, config.seed + 1, count)
    return _noise(config, config.seed + 1, count)


def calibration_pairs(config: DataConfig, count: int, field: str) -> list[tuple[Tensor, Tensor]]:
    """``count`` labelled training batches, for criteria that take gradients (taylor)."""
    source = labelled_source(config.kind, config)
    if source is None:
        raise ConfigError(
            field,
            NO_VALUE,
            f"needs labelled batches (inputs, target) for its gradients and data.kind "
            f"is {config.kind!r}; use data=digits, mnist1d, tinylm or imagefolder",
        )
    return source("train", config.batch_size, limit_batches=count)


def training_data(
    config: DataConfig, batch_size: int
) -> tuple[list[tuple[Tensor, Tensor]], Callable[[nn.Module], float]]:
    """Labelled training batches (the training split) and an accuracy function over the
    evaluation batches, for the ``finetune`` step."""
    source = labelled_source(config.kind, config)
    if source is None:
        raise ConfigError(
            "finetune",
            NO_VALUE,
            f"needs labelled training data and data.kind is {config.kind!r}; "
            "use data=digits, mnist1d, tinylm or imagefolder",
        )
    from surgery.cli.digits import accuracy

    evaluation = load_data(config)
    return source("train", batch_size), lambda model: accuracy(model, evaluation.labelled())


def image_folder_batches(
    config: DataConfig, split: str, batch_size: int, limit_batches: int | None = None
) -> ImageFolderBatches:
    """Labelled batches of a torchvision ``ImageFolder`` (resize, centre crop, normalise), in a
    fixed order: ``test`` is the first ``data.batches`` batches, ``train`` (calibration) the
    images after them, or the same ones when the folder holds no more."""
    from torchvision import datasets, transforms

    size = config.image_size
    resize = config.resize or round(size * 8 / 7)
    _check_fits_in_memory((batch_size, config.channels, resize, resize), field="data.resize")
    grayscale = [transforms.Grayscale(1)] if config.channels == 1 else []
    transform = transforms.Compose(
        [
            *grayscale,
            transforms.Resize(resize),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            transforms.Normalize(config.mean, config.std),
        ]
    )
    _refuse_folder_loops(config.root)
    try:
        folder = datasets.ImageFolder(config.root, transform=transform)
    except (FileNotFoundError, OSError) as err:
        raise ConfigError("data.root", config.root, f"is not a folder of class sub-folders of images ({err})") from None
    order = _classes_interleaved([label for _, label in folder.samples])
    evaluation = min(len(folder), config.batches * batch_size)
    indices = order[:evaluation] if split == "test" else order[evaluation:] or order[:evaluation]
    if split == "test" and len({folder.samples[i][1] for i in indices}) < min(2, len(folder.classes)):
        log.warning("data.root: the evaluation images cover one class only; accuracy says little")
    if limit_batches is not None:
        indices = indices[: limit_batches * batch_size]
    return ImageFolderBatches(folder, indices, batch_size)


def _image(folder: Any, index: int) -> tuple[Tensor, int]:
    """One transformed image of an ``ImageFolder``; a file PIL cannot read (corrupt, truncated,
    or a decompression bomb past PIL's pixel limit) is named in one line."""
    from PIL import Image

    try:
        return folder[index]
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ConfigError(
            "data.root",
            folder.samples[index][0],
            f"cannot be read as an image ({type(err).__name__}: {' '.join(str(err).split())[:160]})",
        ) from None


def _refuse_folder_loops(root: str) -> None:
    """``ImageFolder`` follows symbolic links: a folder reached twice (a link to a parent, or
    two links to one folder) would repeat its images, or never end."""
    seen: dict[str, str] = {}
    for path, _, _ in os.walk(root, followlinks=True):
        real = os.path.realpath(path)
        if real in seen:
            raise ConfigError(
                "data.root",
                root,
                f"reaches the folder {real} twice ({seen[real]} and {path}): a "
                "symbolic link loop, or two links to one folder, would repeat its images",
            )
        seen[real] = path
        if len(seen) > 100_000:
            raise ConfigError("data.root", root, "holds more than 100000 folders")


def _classes_interleaved(labels: list[int]) -> list[int]:
    """Sample indices taking each class in turn (a folder lists its images class by class, so
    the first batches would otherwise hold one class)."""
    by_class: dict[int, list[int]] = {}
    for index, label in enumerate(labels):
        by_class.setdefault(label, []).append(index)
    queues = list(by_class.values())
    return [queue[rank] for rank in range(max(map(len, queues), default=0)) for queue in queues if rank < len(queue)]


class TokenBatches(Sequence):
    """``count`` dict batches ``{input_ids, attention_mask}`` of ``batch_size × seq_len``: seeded
    random ids below ``vocab_size``, or windows of a local text file through a local tokenizer."""

    def __init__(self, config: DataConfig, seed: int, count: int) -> None:
        self.config, self.seed, self.count = config, seed, count
        self.ids = _tokenised(config) if config.text else None

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        config = self.config
        shape = (config.batch_size, config.seq_len)
        generator = torch.Generator().manual_seed(self.seed)
        for index in range(self.count):
            if self.ids is None:
                ids = torch.randint(0, config.vocab_size, shape, generator=generator)
            else:
                step = shape[0] * shape[1]
                start = (index * step + self.seed * 7919 * step) % max(len(self.ids) - step, 1)
                ids = self.ids[start : start + step].reshape(shape)
            yield {"input_ids": ids, "attention_mask": torch.ones(shape, dtype=torch.long)}

    def __getitem__(self, index: int) -> dict[str, Tensor]:  # type: ignore[override]
        return list(self)[index]


def token_dicts(config: DataConfig, seed: int, count: int) -> TokenBatches:
    if config.vocab_size is None and config.text is None:
        raise ConfigError(
            "data.vocab_size",
            None,
            "data=tokens needs the vocabulary size (taken from the model's config.vocab_size when it has one)",
        )
    _check_fits_in_memory((config.batch_size, config.seq_len), itemsize=8)
    return TokenBatches(config, seed, count)


def _tokenised(config: DataConfig) -> Tensor:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("data.tokenizer", config.tokenizer, "needs transformers: pip install 'surgery[hf]'") from None
    refuse_custom_code(config.tokenizer, "data.tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - whatever a broken tokenizer file raises (JSON, KeyError, OSError)
        raise ConfigError(
            "data.tokenizer",
            config.tokenizer,
            f"cannot be loaded as a tokenizer ({type(err).__name__}: {' '.join(str(err).split())[:160]})",
        ) from None
    try:
        text = Path(config.text).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("data.text", config.text, f"is not UTF-8 text (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise ConfigError("data.text", config.text, f"cannot be read: {' '.join(str(err).split())[:160]}") from None
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    if config.vocab_size is not None and len(ids) and int(ids.max()) >= config.vocab_size:
        raise ConfigError(
            "data.tokenizer",
            config.tokenizer,
            f"gives token ids up to {int(ids.max())}, beyond the "
            f"model's vocabulary of {config.vocab_size}; use the model's own tokenizer",
        )
    if len(ids) < config.batch_size * config.seq_len:
        raise ConfigError(
            "data.text",
            config.text,
            f"holds {len(ids)} tokens, fewer than one batch ({config.batch_size} × {config.seq_len})",
        )
    return ids


def with_model_defaults(config: DataConfig, model: nn.Module) -> DataConfig:
    """``config`` with what it left to the model filled in (the vocabulary size of ``tokens``)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if config.kind == "tokens" and config.vocab_size is None and isinstance(vocab, int):
        return dataclasses.replace(config, vocab_size=vocab)
    return config


def _noise(config: DataConfig, seed: int, count: int) -> SyntheticBatches:
    shape = (config.batch_size, config.channels, config.image_size, config.image_size)
    _check_fits_in_memory(shape)
    return SyntheticBatches(shape, seed, count)


def _check_fits_in_memory(shape: tuple[int, ...], itemsize: int = 4, field: str | None = None) -> None:
    """Refuse a batch larger than a quarter of this machine's memory before allocating it
    (``field``: the setting to name, when it is not image_size or batch_size)."""
    needed = math.prod(shape) * itemsize
    try:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if needed > available // 4:
        if len(shape) == 2:  # token ids
            field = "data.seq_len" if shape[1] >= shape[0] else "data.batch_size"
            raise ConfigError(
                field,
                shape[1] if field == "data.seq_len" else shape[0],
                f"one batch of {shape} token "
                f"ids needs {needed / 2**30:.1f} GiB, more than a quarter of this machine's "
                f"{available / 2**30:.1f} GiB",
            )
        field = field or ("data.image_size" if shape[2] * shape[3] >= shape[0] * shape[1] else "data.batch_size")
        raise ConfigError(
            field,
            shape[0] if field == "data.batch_size" else shape[2],
            f"one batch of shape {shape} needs {needed / 2**30:.1f} GiB, more than a quarter of this "
            f"machine's {available / 2**30:.1f} GiB; use smaller batches or images",
        )
