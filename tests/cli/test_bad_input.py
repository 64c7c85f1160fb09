"""Every row of the bad-input table (docs/errors.md): the CLI exits 2 with one line naming the field,
the Python API raises a specific exception, and nothing is lost or half-modified.

Each case id below is a row id of the table ("## Bad input" in docs/errors.md); a test checks the
table and these cases list the same ids, so neither can drift from the other.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torchvision
from cli_runner import run_cli  # tests/cli_runner.py
from safetensors.torch import save_file
from support import image_folder, local_tokenizer, tiny_llama, tiny_moe  # tests/support.py
from torch import nn

import surgery
from surgery import GridSpec
from surgery.analysis import attribution_memory
from surgery.cli.config_loading import load_config
from surgery.core.checkpoints import load_checkpoint, save_checkpoint
from surgery.core.errors import (
    AlreadyModifiedError,
    CheckpointError,
    ConfigError,
    ConfigTypeError,
    OutputExistsError,
    OutputWriteError,
    SelectionError,
)
from surgery.ops.numerics.observers import NonFiniteError
from surgery.ops.rewrite.rewriting import Normalize, rewrite_from_config
from surgery.testing import global_hook_counts, module_hook_counts, snapshot, snapshot_differences

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "docs" / "errors.md"
FAST = ("model.name=resnet18", "data.image_size=64", "data.batch_size=2", "data.batches=1")
QUANTIZE = ("recipe=quantize_resnet50", *FAST)
REWRITE = ("recipe=rewrite_inputs", *FAST)


def table_ids() -> list[str]:
    """The row ids (first column) of the documentation's bad-input table."""
    section = TABLE.read_text().split("## Bad input", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z0-9-]+)` \|", section, flags=re.MULTILINE)


# ----------------------------------------------------------------------------- Python API


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).eval()


def batch(*shape: int, fill: float | None = None) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    return x if fill is None else x.index_fill_(0, torch.tensor([0]), fill)


def int_weight(model: nn.Module) -> nn.Module:
    model[0].weight = nn.Parameter(torch.ones(16, 8, dtype=torch.int64), requires_grad=False)
    return model


def nonfinite_weight(value: float) -> Callable[[nn.Module], nn.Module]:
    def poison(model: nn.Module) -> nn.Module:
        with torch.no_grad():
            model[2].weight[3, 5] = value
        return model

    return poison


def write_checkpoint(kind: str, folder: Path) -> Path:
    """A checkpoint for :func:`mlp` that is ``missing``, ``truncated``, of the ``wrong`` architecture,
    or ``code`` (a pickled module: refused by weights_only=True)."""
    path = folder / ("ckpt.safetensors" if kind == "truncated_safetensors" else "ckpt.pt")
    if kind == "truncated_safetensors":
        save_file(mlp().state_dict(), str(path))
        path.write_bytes(path.read_bytes()[:200])
    elif kind == "truncated":
        torch.save(mlp().state_dict(), path)
        path.write_bytes(path.read_bytes()[:300])
    elif kind == "wrong":
        torch.save(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).state_dict(), path)
    elif kind == "code":
        torch.save({"model": mlp()}, path)
    return path


def typed_checkpoint(kind: str, folder: Path) -> Path:
    """A checkpoint for :func:`mlp` with the right keys and shapes but ``int32``, ``bool``,
    ``quantized`` or ``sparse`` tensors (before: loaded silently, truncating the weights)."""
    state = mlp().state_dict()
    if kind in ("int32", "bool"):
        state = {k: v.to(getattr(torch, kind)) for k, v in state.items()}
    elif kind == "meta":
        state["0.weight"] = torch.empty(state["0.weight"].shape, device="meta")
    elif kind == "float64":
        state["0.weight"] = state["0.weight"].double().index_fill_(0, torch.tensor([0]), 1e300)
    elif kind == "quantized":
        state["0.weight"] = torch.quantize_per_tensor(state["0.weight"], 0.1, 0, torch.qint8)
    else:
        state["0.weight"] = state["0.weight"].to_sparse()
    path = folder / f"ckpt_{kind}.pt"
    torch.save(state, path)
    return path


def qparams_values(scale: Any, zero_point: Any = 0) -> dict[str, Any]:
    """Per-tensor activation parameters for layer 0 (affine 8-bit: zero points in [0, 255])."""
    as_tensor = lambda v, dtype: torch.tensor(v, dtype=dtype) if isinstance(v, (int, float)) else v  # noqa: E731
    return {"0.scale": as_tensor(scale, torch.float32), "0.zero_point": as_tensor(zero_point, torch.int32)}


def _quantize_from(qparams: dict[str, Any]) -> Callable:
    return lambda m, *_: surgery.quantize(m, weights=None, activations=GridSpec(), select="0", qparams=qparams)


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = mlp()

    def forward(self, x):
        y = self.inner(x)
        return y, 2 * y


class WithLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


def on_meta() -> nn.Module:
    with torch.device("meta"):
        return mlp()


def in_inference_mode() -> nn.Module:
    with torch.inference_mode():
        return mlp()


def build_mlp_under(*rules: surgery.rules.Rule) -> nn.Module:
    with surgery.intercept(*rules, strict=True):
        return mlp()


def qparams_for(*, channels: int) -> dict[str, torch.Tensor]:
    """Per-channel activation parameters for layer 0 with ``channels`` entries (it has 16)."""
    return {"0.scale": torch.full((channels,), 0.1), "0.zero_point": torch.zeros(channels, dtype=torch.int32)}


@dataclass
class ApiCase:
    """``call(model, tmp_path, prepared)`` must raise ``error`` with a one-line message naming ``field``
    and ``value``, leaving ``model`` (after ``prepare``) bit-identical."""

    row: str
    call: Callable[[nn.Module, Path, Any], Any]
    error: type[Exception]
    field: str
    value: str
    build: Callable[[], nn.Module] = mlp
    prepare: Callable[[nn.Module], Any] = lambda model: None

    def __str__(self) -> str:
        return f"{self.row}:{self.field}={self.value}"


def _quantize_activations(model: nn.Module, **kwargs: Any) -> Any:
    return surgery.quantize(model, weights=None, activations=dict(kwargs), calibration=[batch(4, 8)], progress=False)


def _gptq_within_budget(model: nn.Module, **budget: Any) -> Any:
    with surgery.activation_budget(**budget):
        return surgery.quantize(model, weights=GridSpec(bits=4), method="gptq", calibration=[batch(4, 8)])


def _one_output() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 1))


def _pooled_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).eval()


def _attribution_within(model: nn.Module, available: int) -> Any:
    with mock.patch.object(attribution_memory, "available_memory", return_value=available):
        return surgery.attribution(model, batch(2, 3, 256, 256), select="0")


def _labelled(model: nn.Module) -> list:
    return [(batch(4, 8), torch.zeros(4, dtype=torch.long))]


def _hf_decoder(family: str = "Llama", **settings: Any) -> nn.Module:
    """A seeded one-block Hugging Face decoder of ``family`` built from a config with ``settings``."""
    import transformers

    torch.manual_seed(0)
    shapes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    shapes |= dict(num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    config = getattr(transformers, f"{family}Config")(**shapes | settings)
    return getattr(transformers, f"{family}ForCausalLM")(config).eval()


def _cut_tokenizer(folder: Path) -> Path:
    """A tokenizer folder (named ckpt_*: the API cases' files beside the model) whose tokenizer.json is cut."""
    local_tokenizer(folder, "a tiny corpus for a tiny tokenizer", 40)
    (folder / "tokenizer.json").write_text((folder / "tokenizer.json").read_text()[:400])
    return folder


def _branch_beside_weights(model: nn.Module) -> Any:
    quantized = surgery.quantize(model, weights=GridSpec(bits=4, group_size=16), exclude="lm_head", progress=False)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    return surgery.compose(quantized, surgery.low_rank_branch(quantized, rank=2, calibration=[ids], progress=False))


API_CASES = [
    ApiCase(
        "calibration-dtype",
        lambda m, *_: surgery.quantize(
            m, weights=GridSpec(bits=4), method="gptq", calibration=[batch(4, 8).half()], progress=False
        ),
        ConfigError,
        "quantize.calibration='batch 0'",
        "torch.float16",
    ),
    ApiCase(
        "finetune-labels",
        lambda m, *_: surgery.finetune(m, calibration=[(batch(4, 8), torch.full((4,), 7))], epochs=1, progress=False),
        ConfigError,
        "finetune.calibration",
        "batch 0",
    ),
    ApiCase(
        "finetune-labels",
        lambda m, *_: surgery.finetune(m, calibration=[(batch(4, 8), torch.rand(4))], epochs=1, progress=False),
        ConfigError,
        "finetune.calibration",
        "batch 0",
    ),
    ApiCase(
        "rebuild-plan",
        lambda m, *_: surgery.rebuild(
            mlp, {"0": {"class": "torch.nn.modules.linear.Linear", "attributes": {"forward": 1}}}
        ),
        ConfigError,
        "rebuild.plan['0'].attributes.forward",
        "not an attribute shrink changes",
    ),
    ApiCase(
        "shrink", lambda m, *_: surgery.shrink(m, 1.5, calibration=batch(2, 8)), ConfigError, "shrink.amount", "1.5"
    ),
    ApiCase(
        "sensitivity",
        lambda m, *_: surgery.sensitivity(m, progress=False),
        ConfigError,
        "sensitivity.calibration",
        "evaluate",
    ),
    ApiCase(
        "sensitivity",
        lambda m, *_: surgery.prune(m, 0.5, amounts={"nope": 0.5}, progress=False),
        ConfigError,
        "prune.amounts",
        "'nope'",
    ),
    ApiCase(
        "calibrated",
        lambda m, *_: surgery.prune(m, 0.5, method="sparsegpt", progress=False),
        ConfigError,
        "prune.calibration",
        "sparsegpt",
    ),
    ApiCase(
        "calibrated",
        lambda m, *_: surgery.quantize(m, weights=GridSpec(), method="gptq", progress=False),
        ConfigError,
        "quantize.calibration",
        "gptq",
    ),
    ApiCase(
        "pattern",
        lambda m, *_: surgery.prune(m, 0.7, pattern="2:4", progress=False),
        ConfigError,
        "prune.amount",
        "0.7",
    ),
    ApiCase(
        "pattern",
        lambda m, *_: surgery.prune(m, 0.5, pattern="2-4", progress=False),
        ConfigError,
        "prune.pattern",
        "'2-4'",
    ),
    ApiCase(
        "finetune-settings",
        lambda m, *_: surgery.finetune(m, calibration=_labelled(m), epochs=-1, progress=False),
        ConfigError,
        "finetune.epochs",
        "-1",
    ),
    ApiCase(
        "finetune-settings",
        lambda m, *_: surgery.finetune(m, calibration=_labelled(m), optimizer="adamx", progress=False),
        ConfigError,
        "finetune.optimizer",
        "'adamx'",
    ),
    ApiCase(
        "finetune-data",
        lambda m, *_: surgery.finetune(m, calibration=[batch(4, 8)], progress=False),
        ConfigTypeError,
        "finetune.calibration",
        "'Tensor'",
    ),
    ApiCase(
        "qat-settings",
        lambda m, *_: surgery.quantize(
            m, activations={"bits": 8}, calibration=[batch(4, 8)], train=True, freeze_observers_after=-1, progress=False
        ),
        ConfigError,
        "quantize.freeze_observers_after",
        "-1",
    ),
    ApiCase("amount", lambda m, *_: surgery.prune(m, 1.5), ConfigError, "prune.amount", "1.5"),
    ApiCase("amount", lambda m, *_: surgery.prune(m, -0.1), ConfigError, "prune.amount", "-0.1"),
    ApiCase("amount", lambda m, *_: surgery.prune(m, math.nan), ConfigError, "prune.amount", "nan"),
    ApiCase("amount", lambda m, *_: surgery.prune(m, "half"), ConfigTypeError, "prune.amount", "'half'"),
    ApiCase("prune-n", lambda m, *_: surgery.prune(m, 0.5, method="ln_structured", n=0), ConfigError, "prune.n", "0"),
    ApiCase(
        "prune-dim", lambda m, *_: surgery.prune(m, 0.5, method="ln_structured", dim=5), ConfigError, "prune.dim", "5"
    ),
    ApiCase("bits", lambda m, *_: surgery.quantize(m, weights=GridSpec(bits=9)), ConfigError, "GridSpec.bits", "9"),
    ApiCase("bits", lambda m, *_: surgery.quantize(m, weights={"bits": 9}), ConfigError, "quantize.weights.bits", "9"),
    ApiCase("bits", lambda m, *_: _quantize_activations(m, bits=1), ConfigError, "quantize.activations.bits", "1"),
    ApiCase(
        "observer-settings",
        lambda m, *_: _quantize_activations(m, observer="percentile", percentile=40),
        ConfigError,
        "quantize.activations.percentile",
        "40",
    ),
    ApiCase(
        "observer-settings",
        lambda m, *_: surgery.quantize(m, weights=GridSpec(averaging=0.0)),
        ConfigError,
        "GridSpec.averaging",
        "0.0",
    ),
    ApiCase(
        "counts",
        lambda m, *_: surgery.quantize(m, weights=None, activations=GridSpec(), calibration=[], progress=False),
        ConfigError,
        "quantize.calibration",
        "'0'",
    ),
    ApiCase(
        "drift-bounds",
        lambda m, *_: load_config({"steps": ["prune"], "checks": {"drift": {"min_cosine": 2}}}),
        ConfigError,
        "checks.drift.min_cosine",
        "2",
    ),
    ApiCase(
        "drift-bounds",
        lambda m, *_: load_config({"steps": ["prune"], "checks": {"drift": {"max_abs": -1}}}),
        ConfigError,
        "checks.drift.max_abs",
        "-1",
    ),
    ApiCase(
        "rewrite-params",
        lambda m, *_: surgery.rewrite_inputs(m, Normalize(mean=0.0, std=0.0)),
        ConfigError,
        "rewrite.std",
        "0.0",
    ),
    ApiCase(
        "rewrite-params",
        lambda m, *_: rewrite_from_config("clamp", min=1.0, max=0.0),
        ConfigError,
        "rewrite.kwargs.max",
        "0.0",
    ),
    ApiCase("method", lambda m, *_: surgery.prune(m, 0.5, method="l7"), ConfigError, "prune.method", "'l7'"),
    ApiCase("method", lambda m, *_: surgery.prune(m, 0.5, scope="world"), ConfigError, "prune.scope", "'world'"),
    ApiCase("method", lambda m, *_: surgery.quantize(m, where="middle"), ConfigError, "quantize.where", "'middle'"),
    ApiCase(
        "observer",
        lambda m, *_: surgery.quantize(m, weights=GridSpec(observer="median")),
        ConfigError,
        "GridSpec.observer",
        "'median'",
    ),
    ApiCase("rewrite-name", lambda m, *_: rewrite_from_config("melt"), ConfigError, "rewrite.name", "'melt'"),
    ApiCase(
        "rewrite-name",
        lambda m, *_: rewrite_from_config("no_such.module.fn"),
        ConfigError,
        "rewrite.name",
        "'no_such.module.fn'",
    ),
    ApiCase("rewrite-name", lambda m, *_: surgery.rewrite_inputs(m, "melt"), ConfigTypeError, "rewrite.fn", "'melt'"),
    ApiCase(
        "unknown-key",
        lambda m, *_: surgery.quantize(m, weights={"bits": 8, "colour": 1}),
        ConfigError,
        "quantize.weights",
        "'colour'",
    ),
    ApiCase("build-rule", lambda m, *_: surgery.rules.swap(42, nn.SiLU), ConfigTypeError, "swap.match", "42"),
    ApiCase(
        "build-rule", lambda m, *_: surgery.intercept(nn.ReLU).__enter__(), ConfigTypeError, "intercept.rules", "ReLU"
    ),
    ApiCase(
        "selection",
        lambda m, *_: surgery.prune(m, 0.5, select="layer9.*"),
        SelectionError,
        "prune.select",
        "'layer9.*'",
    ),
    ApiCase(
        "selection", lambda m, *_: surgery.prune(m, 0.5, exclude=["fcc"]), SelectionError, "prune.exclude", "'fcc'"
    ),
    ApiCase("selection", lambda m, *_: surgery.quantize(m, select="nope"), SelectionError, "quantize.select", "'nope'"),
    ApiCase(
        "selection",
        lambda m, *_: surgery.rewrite_inputs(m, rewrite_from_config("identity"), select="nope"),
        SelectionError,
        "rewrite.select",
        "'nope'",
    ),
    ApiCase(
        "per-channel",
        lambda m, *_: surgery.quantize(
            m,
            weights=None,
            select="1",
            calibration=[batch(2, 3, 6, 6)],
            activations=GridSpec(per_channel=True),
            progress=False,
        ),
        ConfigError,
        "quantize.activations.per_channel",
        "True",
        build=convnet,
    ),
    ApiCase(
        "non-floating", lambda m, *_: surgery.prune(m, 0.5), ConfigError, "prune.select", "'0'", prepare=int_weight
    ),
    ApiCase(
        "non-floating", lambda m, *_: surgery.quantize(m), ConfigError, "quantize.select", "'0'", prepare=int_weight
    ),
    ApiCase(
        "duplicate",
        lambda m, *_: surgery.prune(m, 0.3),
        AlreadyModifiedError,
        "prune",
        "0.weight",
        prepare=lambda m: surgery.prune(m, 0.5),
    ),
    ApiCase(
        "duplicate",
        lambda m, *_: surgery.quantize(m),
        AlreadyModifiedError,
        "quantize",
        "0.weight",
        prepare=lambda m: surgery.quantize(m),
    ),
    ApiCase(
        "duplicate",
        lambda m, *_: _quantize_activations(m),
        AlreadyModifiedError,
        "quantize",
        "0",
        prepare=lambda m: _quantize_activations(m),
    ),
    ApiCase(
        "checkpoint", lambda m, tmp, *_: load_checkpoint(m, tmp / "none.pt"), CheckpointError, "checkpoint", "none.pt"
    ),
    ApiCase(
        "checkpoint",
        lambda m, tmp, *_: load_checkpoint(m, write_checkpoint("truncated", tmp)),
        CheckpointError,
        "checkpoint",
        "corrupted or truncated",
    ),
    ApiCase(
        "checkpoint",
        lambda m, tmp, *_: load_checkpoint(m, write_checkpoint("truncated_safetensors", tmp)),
        CheckpointError,
        "checkpoint",
        "corrupted or truncated",
    ),
    ApiCase(
        "checkpoint",
        lambda m, tmp, *_: load_checkpoint(m, write_checkpoint("wrong", tmp)),
        CheckpointError,
        "checkpoint",
        "does not fit Sequential",
    ),
    ApiCase(
        "checkpoint",
        lambda m, tmp, *_: load_checkpoint(m, write_checkpoint("code", tmp)),
        CheckpointError,
        "checkpoint",
        "weights_only=True",
    ),
    ApiCase(
        "qparams",
        lambda m, *_: surgery.quantize(
            m, weights=None, activations=GridSpec(per_channel=True), select="0", qparams=qparams_for(channels=3)
        ),
        CheckpointError,
        "quantize.qparams",
        "length 16",
    ),
    ApiCase(
        "qparams",
        lambda m, tmp, *_: surgery.quantize(m, weights=None, activations=GridSpec(), qparams=tmp / "none.safetensors"),
        CheckpointError,
        "quantize.qparams",
        "no such file",
    ),
    ApiCase(
        "nonfinite-weights",
        lambda m, *_: surgery.prune(m, 0.5),
        ConfigError,
        "prune.select",
        "'2.weight'",
        prepare=nonfinite_weight(math.nan),
    ),
    ApiCase(
        "nonfinite-weights",
        lambda m, *_: surgery.quantize(m),
        NonFiniteError,
        "quantize.weights",
        "'2.weight'",
        prepare=nonfinite_weight(math.inf),
    ),
    ApiCase(
        "nonfinite-inputs",
        lambda m, *_: surgery.quantize(
            m, weights=None, activations=GridSpec(), calibration=[batch(4, 8, fill=math.nan)], progress=False
        ),
        NonFiniteError,
        "quantize.calibration",
        "'batch 0'",
    ),
    ApiCase(
        "nonfinite-inputs",
        lambda m, *_: surgery.compare(m, mlp(), [batch(4, 8), batch(4, 8, fill=-math.inf)]),
        ConfigError,
        "compare.inputs",
        "'batch 1'",
    ),
    *[
        ApiCase(
            "checkpoint-dtype",
            lambda m, tmp, *_, kind=kind: load_checkpoint(m, typed_checkpoint(kind, tmp)),
            CheckpointError,
            "checkpoint",
            f"key '0.weight' {what}",
        )
        for kind, what in (
            ("int32", "has dtype torch.int32; the model expects torch.float32"),
            ("bool", "has dtype torch.bool"),
            ("quantized", "is a tensor of quantized dtype torch.qint8"),
            ("sparse", "is a tensor of layout torch.sparse_coo"),
            ("meta", "is a meta tensor and holds no values"),
            ("float64", "holds 1e+300, beyond the range of the model's torch.float32"),
        )
    ],
    *[
        ApiCase("qparams-values", _quantize_from(qparams_values(*values)), CheckpointError, "quantize.qparams", what)
        for values, what in (
            ((math.nan,), "0.scale holds nan"),
            ((math.inf,), "0.scale holds inf"),
            ((0.0,), "0.scale holds 0.0"),
            ((-0.5,), "0.scale holds -0.5"),
            ((1e-40,), "not denormal"),
            ((0.1, 256), "0.zero_point holds 256; it must lie in [0, 255]"),
            ((torch.tensor(1e300, dtype=torch.float64),), "0.scale holds 1e+300"),
            ((3e38,), "representable in float32"),
            ((0.1, torch.tensor(1.5)), "zero_point has dtype torch.float32"),
            ((0.1, "0"), "0.zero_point is str; it must be a tensor"),
        )
    ],
    ApiCase("huge-number", lambda m, *_: surgery.prune(m, 10**400), ConfigError, "prune.amount", "(401 characters)"),
    ApiCase("huge-number", lambda m, *_: Normalize(mean=0.0, std=[10**400]), ConfigError, "rewrite.std", "characters"),
    ApiCase("import-path", lambda m, *_: rewrite_from_config("..a.b"), ConfigError, "rewrite.name", "'..a.b'"),
    ApiCase("import-path", lambda m, *_: surgery.select(m, "type:..x.Y"), SelectionError, "select", "type:..x.Y"),
    ApiCase("import-path", lambda m, *_: surgery.rewrite_inputs(m, os.system), ConfigError, "rewrite.fn", "'system'"),
    ApiCase("api-misuse", lambda m, *_: surgery.prune(m, 0.5, dim="a"), ConfigTypeError, "prune.dim", "'a'"),
    ApiCase("api-misuse", lambda m, *_: surgery.compose(), ConfigError, "compose.handles", "=0"),
    ApiCase("api-misuse", lambda m, *_: surgery.compose(None), ConfigTypeError, "compose.handles", "None"),
    ApiCase("api-misuse", lambda m, *_: surgery.select(m, m[0]), ConfigTypeError, "select", "'Linear'"),
    ApiCase(
        "api-misuse",
        lambda m, *_: surgery.compare(mlp(), m, batch(4, 8)),
        ConfigError,
        "compare.candidate",
        "'2 output tensor(s)'",
        build=TwoOutputs,
    ),
    ApiCase(
        "meta-inference", lambda m, *_: surgery.prune(m, 0.5), ConfigError, "prune.select", "meta device", build=on_meta
    ),
    ApiCase(
        "meta-inference",
        lambda m, *_: surgery.quantize(m),
        ConfigError,
        "quantize.select",
        "meta device",
        build=on_meta,
    ),
    ApiCase(
        "meta-inference",
        lambda m, *_: surgery.prune(m, 0.5),
        ConfigError,
        "prune.select",
        "inference_mode",
        build=in_inference_mode,
    ),
    ApiCase(
        "meta-inference",
        lambda m, *_: surgery.quantize(m),
        ConfigError,
        "quantize.select",
        "inference_mode",
        build=in_inference_mode,
    ),
    ApiCase(
        "regex",
        lambda m, *_: surgery.prune(m, 0.5, select="re:(.*.*)*z"),
        SelectionError,
        "prune.select",
        "exponential time",
    ),
    ApiCase(
        "regex",
        lambda m, *_: surgery.prune(m, 0.5, select="re:(?:.|..)*Z"),
        SelectionError,
        "prune.select",
        "exponential time",
    ),
    ApiCase(
        "regex",
        lambda m, *_: surgery.prune(m, 0.5, select="conv[z-a]"),
        SelectionError,
        "prune.select",
        "not a valid glob",
    ),
    ApiCase(
        "empty-selection",
        lambda m, *_: surgery.quantize(m, select=nn.LSTM),
        ConfigError,
        "quantize.select",
        "selects no floating weight",
        build=WithLSTM,
    ),
    ApiCase(
        "never-fired",
        lambda m, *_: build_mlp_under(surgery.rules.swap(nn.GELU, lambda old: nn.SiLU())),
        surgery.RuleNeverFiredError,
        "swap(GELU)",
        "never fired",
    ),
    ApiCase(
        "float-format",
        lambda m, *_: surgery.quantize(m, weights=GridSpec(format="fp8_e4m3", group_size=3)),
        ConfigError,
        "quantize.weights.group_size",
        "does not divide the 8 inputs of 0.weight",
    ),
    ApiCase(
        "float-format",
        lambda m, *_: surgery.quantize(
            m, weights=None, activations=GridSpec(format="mxfp4"), calibration=[batch(4, 8)]
        ),
        ConfigError,
        "quantize.activations.format",
        "activations take one static scale here",
    ),
    ApiCase(
        "distill",
        lambda m, *_: surgery.finetune(
            m, calibration=[(batch(4, 8), torch.zeros(4, dtype=torch.long))], teacher=nn.Linear(8, 3), progress=False
        ),
        ConfigError,
        "finetune.teacher",
        "its output has shape (4, 3) where the student's output has (4, 4)",
    ),
    ApiCase(
        "distill",
        lambda m, *_: surgery.finetune(
            m,
            calibration=[(batch(4, 8), torch.zeros(4, dtype=torch.long))],
            teacher=nn.Sequential(nn.Linear(8, 4)),
            distill={"features": ["2"]},
            progress=False,
        ),
        ConfigError,
        "finetune.distill.features",
        "is in the student but not in the teacher",
    ),
    ApiCase(
        "attribution",
        lambda m, *_: surgery.attribution(m, batch(4, 8), select="2"),
        ConfigError,
        "attribution.select",
        "no spatial or token axis to map",
    ),
    ApiCase(
        "attribution",
        lambda m, *_: surgery.attribution(m, batch(2, 3, 8, 8), select="0", target=10),
        ConfigError,
        "attribution.target",
        "is not a class index: the model has 4 classes",
        build=lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval(),
    ),
    ApiCase(
        "dynamic-activations",
        lambda m, *_: surgery.quantize(m, activations=GridSpec(dynamic="token"), where="tensors"),
        ConfigError,
        "quantize.where",
        "places static scales as graph runtimes do",
    ),
    ApiCase(
        "awq",
        lambda m, *_: surgery.awq(m, weights=GridSpec(bits=4, group_size=8)),
        ConfigError,
        "awq.calibration",
        "awq needs calibration batches: pass calibration=",
    ),
    ApiCase(
        "rotate",
        lambda m, *_: surgery.rotate(m, calibration=[batch(4, 8)]),
        ConfigError,
        "rotate",
        "has no embedding writing a residual stream to rotate",
    ),
    ApiCase(
        "kv-cache",
        lambda m, *_: surgery.quantize_kv_cache(m, calibration=[batch(4, 8)]),
        ConfigError,
        "kv_cache",
        "has no attention module with k_proj and v_proj",
    ),
    ApiCase(
        "owl",
        lambda m, *_: surgery.owl_amounts(m, [batch(4, 8)], 0.05),
        ConfigError,
        "owl.lam",
        "moves a block's sparsity outside [0, 1] around 0.05",
    ),
    ApiCase(
        "owl",
        lambda m, *_: surgery.owl_amounts(m, [batch(4, 8)], 0.5),
        ConfigError,
        "owl.blocks",
        "has no repeated blocks",
    ),
    ApiCase(
        "activation-budget",
        lambda m, *_: _gptq_within_budget(m, max_bytes=-1),
        ConfigError,
        "activation_budget.max_bytes",
        "must be null or an integer number of bytes >= 0",
    ),
    ApiCase(
        "activation-budget",
        lambda m, *_: _gptq_within_budget(m, max_bytes=0, folder="/no/such/folder"),
        ConfigError,
        "activation_budget.folder",
        "must be an existing folder",
    ),
    ApiCase(
        "output-exists",
        lambda m, tmp, *_: save_checkpoint(m, tmp / "model.safetensors"),
        OutputExistsError,
        "output",
        "model.safetensors",
    ),
    ApiCase(
        "output-exists",
        lambda m, tmp, handle: handle.save_qparams(tmp / "model.safetensors"),
        OutputExistsError,
        "output",
        "model.safetensors",
        prepare=_quantize_activations,
    ),
    ApiCase(
        "degenerate-calibration",
        lambda m, *_: surgery.quantize_kv_cache(m, calibration=[torch.zeros(2, 8, dtype=torch.long)], progress=False),
        ConfigError,
        "quantize.calibration='model.layers.0.self_attn.k_proj'",
        "no range to quantize it by can be learned",
        build=lambda: tiny_llama(layers=1),
    ),
    ApiCase(
        "distill-one-class",
        lambda m, *_: surgery.finetune(
            m,
            calibration=[(batch(4, 8), torch.zeros(4, 1))],
            teacher=_one_output(),
            loss=nn.functional.mse_loss,
            progress=False,
        ),
        ConfigError,
        "finetune.distill.weight",
        "0.5",
        build=lambda: _one_output(),
    ),
    ApiCase(
        "attribution-memory",
        lambda m, *_: _attribution_within(m, 2**20),
        ConfigError,
        "attribution.inputs",
        "shape (2, 3, 256, 256)",
        build=lambda: _pooled_cnn(),
    ),
    ApiCase(
        "export-other-handle",
        lambda m, tmp, handle: _export_beside_a_rewrite(m, tmp, handle),
        ConfigError,
        "export.handle",
        "rewrite handle",
        prepare=lambda m: surgery.quantize(m, weights=GridSpec(bits=8, symmetric=True, per_channel=True)),
    ),
    ApiCase(
        "kv-cache-export",
        lambda m, tmp, _: _export_kv_cache(m, tmp),
        ConfigError,
        "kv_cache",
        "k_proj/v_proj outputs",
        build=lambda: tiny_llama(layers=1),
    ),
    ApiCase(
        "export-write",
        lambda m, tmp, handle: surgery.export(handle, tmp / "model.safetensors" / "m.safetensors"),
        OutputWriteError,
        "export.path",
        "cannot be written",
        prepare=lambda m: surgery.prune(m, 0.5),
    ),
    ApiCase(
        "export-write",
        lambda m, tmp, handle: surgery.export(handle, tmp / "m.pt", format="torchao", inputs=batch(4, 5)),
        ConfigError,
        "export.inputs='batch 0'",
        "Sequential fails on it",
        prepare=lambda m: surgery.quantize(m, weights=GridSpec(per_channel=True), activations=None, target="torchao"),
    ),
    ApiCase(
        "attribution",
        lambda m, *_: surgery.attribution(m, batch(4, 8), method="input_x_gradient", target=1.5),
        ConfigError,
        "attribution.target=1.5",
        "must be a class index",
    ),
    ApiCase(
        "experts-calibration",
        lambda m, *_: surgery.quantize(
            m,
            weights=GridSpec(bits=4),
            method="gptq",
            calibration=[{"input_ids": torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))}],
            progress=False,
        ),
        ConfigError,
        "quantize.calibration='model.layers.0.mlp.experts.",
        "was sent no calibration token by its router",
        build=lambda: tiny_moe("gpt_oss", layers=2),
    ),
    ApiCase(
        "experts-export",
        lambda m, tmp, handle: surgery.export(handle, tmp / "folder", format="compressed-tensors"),
        ConfigError,
        "export.format='compressed-tensors'",
        "gpt_oss experts (model.layers.0.mlp.experts) have no per-expert checkpoint names",
        build=lambda: tiny_moe("gpt_oss", layers=1),
        prepare=lambda m: surgery.quantize(m, weights=GridSpec(bits=8, symmetric=True)),
    ),
    ApiCase(
        "experts-amount",
        lambda m, *_: surgery.prune_experts(m, 0.75, calibration=[torch.randint(0, 128, (2, 16))]),
        ConfigError,
        "prune_experts.amount=0.75",
        "leaves 1 expert per layer, fewer than the top_k=2",
        build=lambda: tiny_moe("qwen3_moe", layers=1),
    ),
    ApiCase(
        "actorder",
        lambda m, *_: surgery.quantize(m, weights=GridSpec(bits=4), method={"name": "gptq", "actorder": "dynamic"}),
        ConfigError,
        "quantize.method.actorder",
        "dynamic",
    ),
    ApiCase(
        "actorder",
        lambda m, *_: surgery.quantize(m, weights={"bits": 4}, method={"name": "rtn", "actorder": "weight"}),
        ConfigError,
        "quantize.method",
        "has no settings of its own; got ['actorder']",
    ),
    ApiCase(
        "low-rank-rank",
        lambda m, tmp, handle: surgery.low_rank_branch(handle, rank=20, calibration=[batch(4, 8)], progress=False),
        ConfigError,
        "low_rank_branch.rank",
        "20",
        prepare=lambda m: surgery.quantize(m, weights=GridSpec(bits=4), progress=False),
    ),
    ApiCase(
        "autoround-iterations",
        lambda m, *_: surgery.quantize(m, weights={"bits": 4}, method={"name": "autoround", "iterations": 0}),
        ConfigError,
        "quantize.method.iterations",
        "0",
    ),
    ApiCase(
        "experts-in-memory",
        lambda m, *_: surgery.prune_experts(tiny_moe("qwen3_moe", layers=1).to("meta"), 1, criterion="random"),
        ConfigError,
        "prune_experts='model.layers.0.mlp.experts.gate_up_proj'",
        "is on the meta device",
        build=lambda: tiny_moe("qwen3_moe", layers=1),
    ),
    ApiCase(
        "plan-budget",
        lambda m, *_: surgery.plan(m, "1bpw", ["w4g128"], calibration=[batch(4, 8)]),
        ConfigError,
        "plan.budget",
        "smallest reachable: 5.29 bpw",
    ),
    ApiCase(
        "plan-kv",
        lambda m, *_: surgery.plan(m, 10**7, ["dense", "kv_int8"], calibration=[torch.randint(0, 128, (1, 8))]),
        ConfigError,
        "plan.kv_tokens",
        "must be the tokens the cache holds",
        build=lambda: tiny_llama(layers=1),
    ),
    ApiCase(
        "rotate-learn",
        lambda m, *_: surgery.rotate(m, calibration=[torch.randint(0, 128, (1, 8))], learn={"steps": 0}),
        ConfigError,
        "rotate.learn.steps",
        "0",
        build=lambda: tiny_llama(layers=2),
    ),
    ApiCase(
        "imatrix-mse",
        lambda m, *_: surgery.quantize(m, weights={"observer": "imatrix_mse", "group_size": 4}, method="autoround"),
        ConfigError,
        "quantize.weights.observer",
        "method 'autoround' picks its own",
    ),
    ApiCase(
        "imatrix-mse",
        lambda m, *_: surgery.quantize(m, weights={"observer": "imatrix_mse", "per_channel": True}),
        ConfigError,
        "quantize.calibration",
        "weighs each input column by its energy in calibration",
    ),
    ApiCase(
        "full-range",
        lambda m, *_: surgery.quantize(
            m, weights={"observer": "percentile", "group_size": 4}, method="autoround", calibration=[batch(4, 8)]
        ),
        ConfigError,
        "quantize.weights.observer",
        "autoround tunes each group's range from its extremes",
    ),
    ApiCase(
        "mixed-export",
        lambda m, tmp, handle: surgery.export(handle, tmp / "llama", format="compressed-tensors"),
        ConfigError,
        "export.format",
        "model.layers.0.mlp.gate_proj has zero points",
        build=lambda: tiny_llama(layers=1),
        prepare=lambda m: _int8_beside_affine_int4(m),
    ),
    ApiCase(
        "gguf",
        lambda m, tmp, handle: surgery.export(handle, tmp / "m.gguf", format="gguf"),
        ConfigError,
        "export.format",
        "cannot hold model.layers.0.self_attn.q_proj.weight exactly: Q4_1 needs groups of 32",
        build=lambda: tiny_llama(layers=1),
        prepare=lambda m: surgery.quantize(m, weights=GridSpec(bits=4, group_size=128), exclude="lm_head"),
    ),
    ApiCase(
        "gguf",
        lambda m, tmp, handle: surgery.export(handle, tmp / "m.gguf", format="gguf", type="Q2_K"),
        ConfigError,
        "export.options.type",
        "Q2_K",
        build=lambda: tiny_llama(layers=1),
        prepare=lambda m: surgery.quantize(m, weights=GridSpec(bits=4), target="gguf:Q4_0", exclude="lm_head"),
    ),
    ApiCase(
        "super-group",
        lambda m, *_: surgery.quantize(m, weights=GridSpec(bits=4), target="gguf:Q6_K", exclude="lm_head"),
        ConfigError,
        "quantize.weights.super_group",
        "does not divide the 64 inputs of model.layers.0.self_attn.q_proj.weight: super groups must be whole",
        build=lambda: tiny_llama(layers=1),
    ),
    ApiCase(
        "super-group",
        lambda m, *_: surgery.quantize(m, weights=GridSpec(bits=4, group_size=16, super_group=256, scale_bits=6)),
        ConfigError,
        "GridSpec.super_group",
        "needs an integer format and scale_dtype",
    ),
    ApiCase(
        "gguf-mix",
        lambda m, *_: surgery.gguf_mix(m, "Q4_K_M"),
        ConfigError,
        "plan.mix",
        "puts model.layers.0.self_attn.q_proj.weight on gguf:Q4_K, whose blocks do not tile its 64 inputs",
        build=lambda: tiny_llama(layers=1),
    ),
    ApiCase(
        "float-offset",
        lambda m, *_: surgery.quantize(m, weights=GridSpec(bits=4, group_size=8, float_offset=True, symmetric=True)),
        ConfigError,
        "GridSpec.float_offset",
        "applies to affine grids (symmetric=false)",
    ),
    ApiCase(
        "float-offset",
        lambda m, tmp, handle: surgery.export(handle, tmp / "llama", format="compressed-tensors"),
        ConfigError,
        "export.format",
        "stores integer zero points; model.layers.0.self_attn.q_proj.weight's groups have float offsets",
        build=lambda: tiny_llama(layers=1),
        prepare=lambda m: surgery.quantize(m, weights=GridSpec(bits=4), target="gguf:Q4_1", exclude="lm_head"),
    ),
    ApiCase(
        "int4",
        lambda m, tmp, handle: surgery.export(handle, tmp / "m.pt", format="int4"),
        ConfigError,
        "export.format",
        "is torch.float32: torch's CPU int4 kernel",
        build=lambda: tiny_llama(layers=1),
        prepare=lambda m: surgery.quantize(m, weights=GridSpec(bits=4, group_size=32), exclude="lm_head"),
    ),
    ApiCase(
        "onnx-nbits",
        lambda m, tmp, handle: surgery.export(handle, tmp / "m.onnx", format="onnx", inputs=[torch.randn(2, 8)]),
        ConfigError,
        "quantize.weights",
        "4-bit affine group 48",
        prepare=lambda m: surgery.quantize(m, weights=GridSpec(bits=4, group_size=48)),
    ),
    ApiCase(
        "gguf-config",
        lambda m, *_: surgery.quantize(m, weights=GridSpec(bits=4), target="gguf:Q4_0", exclude="lm_head"),
        ConfigError,
        "export.format",
        "config.sliding_window is 8 with a context of 64",
        build=lambda: _hf_decoder("Mistral", sliding_window=8),
    ),
    ApiCase(
        "gguf-config",
        lambda m, *_: surgery.gguf_mix(m, "Q4_K_M"),
        ConfigError,
        "export.format",
        "config.hidden_act is 'gelu'",
        build=lambda: _hf_decoder(hidden_act="gelu"),
    ),
    ApiCase(
        "gguf-config",
        lambda m, tmp, handle: surgery.export(handle, tmp / "m.gguf", format="gguf"),
        ConfigError,
        "export.format",
        "config.made_up_knob=3 is not a field it understands",
        build=lambda: _hf_decoder(made_up_knob=3),
        prepare=lambda m: surgery.quantize(m, weights=GridSpec(bits=4, group_size=32), exclude="lm_head"),
    ),
    ApiCase(
        "gguf-target",
        lambda m, *_: surgery.quantize(
            m, weights=GridSpec(bits=4), method="gptq", target="gguf:Q4_0", calibration=[torch.randint(0, 128, (1, 8))]
        ),
        ConfigError,
        "quantize.target",
        "cannot hold model.layers.0.self_attn.q_proj.weight: its 48 inputs are not a multiple of 32",
        build=lambda: tiny_llama(layers=1, hidden=48),
    ),
    ApiCase(
        "gguf-target",
        lambda m, *_: surgery.quantize(
            m,
            weights=GridSpec(bits=4),
            method={"name": "gptq", "actorder": "group"},
            target="gguf:Q4_0",
            calibration=[torch.randint(0, 128, (1, 8))],
        ),
        ConfigError,
        "quantize.method.actorder",
        "holds groups of consecutive inputs only (no g_idx)",
        build=lambda: tiny_llama(layers=1),
    ),
    ApiCase(
        "gguf-mix",
        lambda m, *_: surgery.gguf_mix(m, ["Q4_K_M"]),
        ConfigError,
        "plan.mix",
        "['Q4_K_M']: must be one of Q4_K_M, Q5_K_M (one name, a string)",
        build=lambda: tiny_llama(layers=1),
    ),
    ApiCase(
        "gguf",
        lambda m, tmp, handle: surgery.export(handle, tmp / "m.gguf", format="gguf", type=["Q4_0"]),
        ConfigError,
        "export.options.type",
        "['Q4_0']: must be one of Q8_0",
        build=lambda: tiny_llama(layers=1),
        prepare=lambda m: surgery.quantize(m, weights=GridSpec(bits=4), target="gguf:Q4_0", exclude="lm_head"),
    ),
    ApiCase(
        "export-tokenizer",
        lambda m, tmp, handle: surgery.export(
            handle, tmp / "m.gguf", format="gguf", tokenizer=_cut_tokenizer(tmp / "ckpt_tokenizer")
        ),
        ConfigError,
        "export.options.tokenizer",
        "ckpt_tokenizer/tokenizer.json': is not JSON (JSONDecodeError",
        build=lambda: tiny_llama(layers=1),
        prepare=lambda m: surgery.quantize(m, weights=GridSpec(bits=4), target="gguf:Q4_0", exclude="lm_head"),
    ),
    ApiCase(
        "plan-budget",
        lambda m, *_: surgery.plan(m, "1e400bpw", ["w4g128"], calibration=[batch(4, 8)]),
        ConfigError,
        "plan.budget",
        "'1e400bpw': must be bytes",
    ),
    ApiCase(
        "output-exists",
        lambda m, tmp, *_: surgery.Plan([], 0, "drift", "exact").save(tmp / "model.safetensors"),
        OutputExistsError,
        "output",
        "model.safetensors",
    ),
    ApiCase(
        "output-exists",
        lambda m, tmp, group: group.handles[1].save(tmp / "model.safetensors"),
        ConfigError,
        "low_rank_branch.save.folder",
        "is a file",
        build=lambda: tiny_llama(layers=1, hidden=32),
        prepare=_branch_beside_weights,
    ),
    ApiCase(
        "step-limits",
        lambda m, *_: surgery.quantize(m, method=surgery.AutoRoundSettings(iterations=10**9)),
        ConfigError,
        "quantize.method.iterations",
        "must be a whole number of tuning steps from 1 to 10,000",
    ),
    ApiCase(
        "step-limits",
        lambda m, *_: surgery.rotate(m, calibration=[torch.randint(0, 128, (1, 8))], learn={"steps": 10**9}),
        ConfigError,
        "rotate.learn.steps",
        "from 1 to 10,000",
        build=lambda: tiny_llama(layers=1),
    ),
    ApiCase(
        "step-limits",
        lambda m, *_: surgery.finetune(m, calibration=[(batch(4, 8), torch.zeros(4, dtype=torch.long))], epochs=10**9),
        ConfigError,
        "finetune.epochs",
        "from 0 to 10,000",
    ),
]


def _int8_beside_affine_int4(model: nn.Module) -> Any:
    """Attention on int8 per channel, the MLP on int4 with zero points: two config groups."""
    attention = surgery.quantize(
        model, weights=GridSpec(bits=8, symmetric=True, per_channel=True), select="**.self_attn.*"
    )
    mlp = surgery.quantize(model, weights=GridSpec(bits=4, symmetric=False, group_size=32), select="**.mlp.*")
    return surgery.compose(attention, mlp)


def _export_beside_a_rewrite(model: nn.Module, tmp: Path, handle: Any) -> Any:
    with surgery.rewrite_inputs(model, lambda args, kwargs: (args, kwargs)):  # attached by another handle
        return surgery.export(handle, tmp / "m.pt", format="torchao")


def _export_kv_cache(model: nn.Module, tmp: Path) -> None:
    """A cache quantized beside the weights, written to compressed-tensors (restored after)."""
    pytest.importorskip("compressed_tensors")
    ids = torch.randint(0, 128, (1, 8))
    weights = surgery.quantize(model, weights=GridSpec(bits=8, symmetric=True), select="**.*_proj", progress=False)
    with surgery.compose(weights, surgery.quantize_kv_cache(model, GridSpec(bits=8), calibration=[ids])) as handle:
        surgery.export(handle, tmp / "llama", format="compressed-tensors")


def _model_state(model: nn.Module) -> tuple:
    return snapshot(model), module_hook_counts(model)


@pytest.mark.parametrize("case", API_CASES, ids=str)
def test_api_raises_a_specific_one_line_error_and_leaves_the_model_as_it_was(case: ApiCase, tmp_path: Path):
    model = case.build()
    prepared = case.prepare(model)
    model = prepared if isinstance(prepared, nn.Module) else model
    existing = tmp_path / "model.safetensors"
    existing.write_bytes(b"earlier output")
    before_snapshot, before_hooks = _model_state(model)
    before_global = global_hook_counts()
    with pytest.raises(case.error) as raised:
        case.call(model, tmp_path, prepared)
    message = str(raised.value)
    assert len(message.splitlines()) == 1, message
    assert case.field in message and case.value in message, message
    assert snapshot_differences(before_snapshot, snapshot(model)) == [], "the model changed"
    assert module_hook_counts(model) == before_hooks and global_hook_counts() == before_global
    assert existing.read_bytes() == b"earlier output"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("ckpt")) == ["model.safetensors"]
    if isinstance(prepared, surgery.Handle):
        prepared.restore()


def test_api_errors_are_surgery_errors_the_cli_turns_into_exit_2():
    assert all(issubclass(case.error, surgery.SurgeryError) for case in API_CASES)


# ---------------------------------------------------------------------------- command line


@dataclass
class CliCase:
    """``python -m surgery *args`` must exit 2 with one stderr line naming ``field``."""

    row: str
    args: tuple[str, ...]
    field: str
    setup: Callable[[Path], tuple[str, ...]] | None = None
    # what a user's sitecustomize would replace for the run: {"module.attribute": replacement}
    patches: dict[str, Callable[..., Any]] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.row}:{' '.join(a for a in self.args if a not in FAST)}"


def resnet18_checkpoint(kind: str) -> Callable[[Path], tuple[str, ...]]:
    """A ``model.weights=`` override pointing at a resnet18 checkpoint of the given ``kind``."""

    def write(folder: Path) -> tuple[str, ...]:
        path = folder / ("weights.safetensors" if kind in ("nan", "truncated_safetensors") else "weights.pt")
        if kind == "missing":
            path = folder / "no_such_weights.pt"
        elif kind == "wrong":
            torch.save(torchvision.models.resnet34().state_dict(), path)
        elif kind == "code":
            torch.save({"model": torchvision.models.resnet18()}, path)
        else:
            state = torchvision.models.resnet18().state_dict()
            if kind == "nan":
                state["layer1.0.conv1.weight"][0, 0, 0, 0] = math.nan
                save_file(state, str(path))
            elif kind == "truncated_safetensors":
                save_file(state, str(path))
                path.write_bytes(path.read_bytes()[:4096])
            else:
                torch.save(state, path)
                path.write_bytes(path.read_bytes()[:4096])
        return (f"model.weights={path}",)

    return write


def int32_resnet18(folder: Path) -> tuple[str, ...]:
    path = folder / "weights_int32.pt"
    torch.save({k: v.to(torch.int32) for k, v in torchvision.models.resnet18().state_dict().items()}, path)
    return (f"model.weights={path}",)


def user_module(name: str, source: str) -> Callable[[Path], tuple[str, ...]]:
    """Write ``name.py`` into the case's folder, which the command runs with on PYTHONPATH."""

    def write(folder: Path) -> tuple[str, ...]:
        (folder / f"{name}.py").write_text(source)
        return ()

    return write


def broken_recipe(folder: Path) -> tuple[str, ...]:
    (folder / "user" / "recipe").mkdir(parents=True)
    (folder / "user" / "recipe" / "broken.yaml").write_text("steps: [prune\nprune: {amount: 0.5\n")
    return (f"hydra.searchpath=[file://{folder / 'user'}]", "recipe=broken")


def run_dir_at(kind: str) -> Callable[[Path], tuple[str, ...]]:
    """``hydra.run.dir`` at an existing file, or at /dev/full."""

    def point(folder: Path) -> tuple[str, ...]:
        if kind == "file":
            (folder / "a_file").write_text("not a folder")
            return (f"hydra.run.dir={folder / 'a_file'}",)
        return ("hydra.run.dir=/dev/full",)

    return point


# Fills the disk while the checkpoint is written: sitecustomize runs before surgery is imported.
def disk_full_safetensors(tensors, filename, metadata=None):
    """safetensors' save_file on a full disk."""
    raise OSError(errno.ENOSPC, "No space left on device", str(filename))


HUGE = "1" + "0" * 400


def disk_full_torch_save(obj, f, *args, **kwargs):
    """torch.save filling the disk (the .pt checkpoint, a torchao export): torch raises RuntimeError."""
    raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0")


DIGITS_FINETUNE = ("recipe=prune_finetune_digits", "finetune.epochs=1")
IMAGES = (
    "recipe=prune_resnet50",
    "model.name=resnet18",
    "model.num_classes=2",
    "data=imagefolder",
    "data.image_size=32",
    "data.batch_size=2",
    "data.batches=1",
)
GPT2 = ("recipe=quantize_gpt2_hf",)
LLAMA_RTN = ("recipe=quantize_gptq_llama", "quantize.method=rtn", "quantize.calibration_batches=1")
HELD: list = []  # claims held for the whole test session (a run elsewhere owns the folder)


def images(kind: str) -> Callable[[Path], tuple[str, ...]]:
    """An image folder with one ``corrupt`` PNG, a decompression ``bomb`` (196 megapixels), a
    symlink ``loop``, or a ``good`` one (for the settings' cases)."""

    def make(folder: Path) -> tuple[str, ...]:
        from PIL import Image

        root = image_folder(folder / "images", ("a", "b"), 2, (40, 48), seed=0)
        if kind == "corrupt":
            (root / "a" / "0.png").write_bytes(b"\x89PNG not really")
        elif kind == "bomb":
            Image.new("1", (14_000, 14_000)).save(root / "a" / "0.png")
        elif kind == "loop":
            (root / "a" / "loop").symlink_to(root)
        return (f"data.root={root}",)

    return make


def tokens(kind: str) -> Callable[[Path], tuple[str, ...]]:
    """A local tokenizer and text for data=tokens: the text not UTF-8, the tokenizer.json cut,
    or the tokenizer asking to run its own code (auto_map)."""

    def make(folder: Path) -> tuple[str, ...]:
        text = "surgery puts every change back exactly. " * 40
        tokenizer = local_tokenizer(folder / "tokenizer", text, 60)
        corpus = folder / "corpus.txt"
        corpus.write_bytes(text.encode() + (b"\xff\xfe" if kind == "utf8" else b""))
        if kind == "cut":
            path = tokenizer / "tokenizer.json"
            path.write_text(path.read_text()[:200])
        elif kind == "code":
            path = tokenizer / "tokenizer_config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), "auto_map": {"AutoTokenizer": ["x.Y", None]}}))
        return (f"data.text={corpus}", f"data.tokenizer={tokenizer}")

    return make


def hf_folder(kind: str) -> Callable[[Path], tuple[str, ...]]:
    """A saved GPT-2 folder whose safetensors file is cut, or whose config asks for its own code."""

    def make(folder: Path) -> tuple[str, ...]:
        import transformers

        path = folder / "gpt2"
        transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
        ).save_pretrained(path, safe_serialization=True)
        if kind == "cut":
            weights = path / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[:300])
        elif kind == "code":
            config = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "x.Y"}}))
        return (f"model.path={path}", "model.config=null") if kind != "mismatch" else (f"model.path={path}",)

    return make


def plan_file(text: str) -> Callable[[Path], tuple[str, ...]]:
    def make(folder: Path) -> tuple[str, ...]:
        (folder / "plan.yaml").write_text(text)
        return (f"prune.amounts={folder / 'plan.yaml'}",)

    return make


def busy(folder: Path) -> tuple[str, ...]:
    """The run folder is claimed by another run (this test process) while the CLI runs."""
    from surgery.core.folders import claimed

    claim = claimed(folder / "busy")
    claim.__enter__()
    HELD.append(claim)
    return (f"hydra.run.dir={folder / 'busy'}",)


LAUGHS = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b]\n"

OFFLOAD = ("recipe=quantize_gptq_llama", "model.offload=true", "quantize.weights.group_size=32", "data=tokens")


def offload_folder(kind: str) -> Callable[[Path], tuple[str, ...]]:
    """An offloaded Llama folder naming a transformers function as its architecture, asking to
    run its own code, or a work folder whose manifest surgery did not write."""

    def make(folder: Path) -> tuple[str, ...]:
        path = llama_folder(folder)
        config = json.loads((path / "config.json").read_text())
        if kind == "architectures":
            config["architectures"] = ["pipeline"]
        elif kind == "code":
            config |= {"model_type": "custom", "auto_map": {"AutoConfig": "custom.Config"}}
        (path / "config.json").write_text(json.dumps(config))
        (folder / "blocks" / "quantize").mkdir(parents=True)
        (folder / "blocks" / "quantize" / "manifest.json").write_text(json.dumps({"stages": []}))
        return (f"model.path={path}", f"model.offload_folder={folder / 'blocks'}")

    return make


CLI_CASES = [
    CliCase("output-busy", FAST, "output='", busy),
    CliCase("plan-file", FAST, "prune.amounts='", plan_file("conv1: [0.5\nfc: 0.2:\n")),
    CliCase("plan-file", FAST, "prune.amounts='", plan_file("conv1: !!python/object/apply:os.system ['true']\n")),
    CliCase("plan-file", FAST, "prune.amounts='", plan_file(LAUGHS)),
    CliCase("image-folder", IMAGES, "data.root='", images("corrupt")),
    CliCase("image-folder", IMAGES, "data.root='", images("bomb")),
    CliCase("image-folder", IMAGES, "data.root='", images("loop")),
    CliCase("image-folder", (*IMAGES, "data.std=[0,1,1]"), "data.std=[0.0, 1.0, 1.0]", images("good")),
    CliCase("image-folder", (*IMAGES, "data.resize=0"), "data.resize=0", images("good")),
    CliCase("image-folder", (*IMAGES, "data.channels=2"), "data.channels=2", images("good")),
    CliCase("image-folder", (*IMAGES, "data.resize=100000"), "data.resize=100000", images("good")),
    CliCase("token-files", GPT2, "data.text='", tokens("utf8")),
    CliCase("token-files", GPT2, "data.tokenizer='", tokens("cut")),
    CliCase("token-files", GPT2, "data.tokenizer='", tokens("code")),
    CliCase("hf-folder", GPT2, "model.path='", hf_folder("cut")),
    CliCase("hf-folder", GPT2, "model.path='", hf_folder("code")),
    CliCase("hf-folder", GPT2, "model.config=null drops all of it", hf_folder("mismatch")),  # the recipe's n_layer 2
    CliCase("checkpoint", (*FAST, "model.weights=/dev/zero"), "model.weights='/dev/zero': is not a regular file"),
    CliCase("shrink", ("recipe=shrink_resnet50", "shrink.amount=2"), "shrink.amount=2"),
    CliCase("shrink", ("recipe=shrink_resnet50", "shrink.round_to=0"), "shrink.round_to=0"),
    CliCase(
        "sensitivity", ("recipe=sensitivity", "sensitivity.target_sparsity=0.95"), "sensitivity.target_sparsity=0.95"
    ),
    CliCase("sensitivity", ("recipe=prune_mnist1d", "prune.amounts=missing.yaml"), "prune.amounts='missing.yaml'"),
    CliCase("calibrated", ("recipe=prune_mnist1d", "prune.scope=global"), "prune.scope='global'"),
    CliCase(
        "calibrated", ("recipe=quantize_mnist1d", "quantize.weights.group_size=0"), "quantize.weights.group_size=0"
    ),
    CliCase("pattern", (*FAST, "prune.pattern=2-4"), "prune.pattern"),
    CliCase("pattern", (*FAST, "prune.pattern=2:4"), "prune.pattern"),
    CliCase("pattern", (*FAST, "prune.amount=0.7", "prune.pattern=2:4"), "prune.amount"),
    CliCase("finetune-settings", (*DIGITS_FINETUNE, "finetune.epochs=-1"), "finetune.epochs"),
    CliCase("finetune-settings", (*DIGITS_FINETUNE, "finetune.optimizer=adamx"), "finetune.optimizer"),
    CliCase("finetune-settings", (*DIGITS_FINETUNE, "finetune.lr=nan"), "finetune.lr"),
    CliCase("finetune-data", (*DIGITS_FINETUNE, "data=synthetic"), "finetune"),
    CliCase(
        "qat-settings",
        ("recipe=quantize_digits", "quantize.freeze_observers_after=3"),
        "quantize.freeze_observers_after",
    ),
    CliCase("amount", (*FAST, "prune.amount=1.5"), "prune.amount"),
    CliCase("amount", (*FAST, "prune.amount=-0.1"), "prune.amount"),
    CliCase("amount", (*FAST, "prune.amount=nan"), "prune.amount"),
    CliCase("amount", (*FAST, "prune.amount=half"), "prune.amount"),
    CliCase("prune-n", (*FAST, "prune.n=0"), "prune.n"),
    CliCase("prune-dim", (*FAST, "prune.method=ln_structured", "prune.dim=7"), "prune.dim"),
    CliCase("bits", (*QUANTIZE, "quantize.weights.bits=9"), "quantize.weights.bits"),
    CliCase("bits", (*QUANTIZE, "quantize.activations.bits=1"), "quantize.activations.bits"),
    CliCase(
        "observer-settings",
        (*QUANTIZE, "quantize.activations.observer=percentile", "quantize.activations.percentile=40"),
        "quantize.activations.percentile",
    ),
    CliCase("observer-settings", (*QUANTIZE, "quantize.activations.averaging=0"), "quantize.activations.averaging"),
    CliCase("counts", (*FAST, "data.batch_size=0"), "data.batch_size"),
    CliCase("counts", (*FAST, "data.batches=0"), "data.batches"),
    CliCase("counts", (*FAST, "data.image_size=0"), "data.image_size"),
    CliCase("counts", (*FAST, "data.channels=0"), "data.channels"),
    CliCase("counts", (*FAST, "model.num_classes=0"), "model.num_classes"),
    CliCase("counts", (*QUANTIZE, "quantize.calibration_batches=0"), "quantize.calibration_batches"),
    CliCase("drift-bounds", (*FAST, "checks.drift.min_cosine=2"), "checks.drift.min_cosine"),
    CliCase("drift-bounds", (*FAST, "checks.drift.min_top1_agreement=1.5"), "checks.drift.min_top1_agreement"),
    CliCase("drift-bounds", (*FAST, "checks.drift.max_abs=-1"), "checks.drift.max_abs"),
    CliCase("drift-bounds", (*FAST, "checks.drift.max_accuracy_drop=-1"), "checks.drift.max_accuracy_drop"),
    CliCase("drift-bounds", (*FAST, "checks.drift.min_sqnr_db=nan"), "checks.drift.min_sqnr_db"),
    CliCase("rewrite-params", (*REWRITE, "rewrite.kwargs.std=[1,0,1]"), "rewrite.kwargs.std"),
    CliCase(
        "rewrite-params",
        (
            *REWRITE,
            "rewrite.name=clamp",
            "~rewrite.kwargs.mean",
            "~rewrite.kwargs.std",
            "+rewrite.kwargs.min=1",
            "+rewrite.kwargs.max=0",
        ),
        "rewrite.kwargs.max",
    ),
    CliCase(
        "input-shape", ("model.name=vit_b_16", "data.image_size=64", "data.batch_size=1", "data.batches=1"), "data"
    ),
    CliCase("recipe", (*FAST, "recipe=nope"), "recipe"),
    CliCase("recipe", ("recipe=prune_resnet",), "prune_resnet50"),  # the list of available recipes
    CliCase("model", (*FAST, "model=nope"), "model"),
    CliCase("model", (*FAST, "model.name=resnet5"), "model.name"),
    CliCase("method", (*FAST, "prune.method=l7"), "prune.method"),
    CliCase("method", (*FAST, "prune.scope=world"), "prune.scope"),
    CliCase("method", (*QUANTIZE, "quantize.where=middle"), "quantize.where"),
    CliCase("observer", (*QUANTIZE, "quantize.activations.observer=median"), "quantize.activations.observer"),
    CliCase("dynamic-activations", (*QUANTIZE, "quantize.activations.dynamic=row"), "quantize.activations.dynamic"),
    CliCase("attribution", (*FAST, "+checks.drift.min_attribution_cosine=0.5"), "checks.drift.min_attribution_cosine"),
    CliCase("attribution", ("recipe=explain", "attribution.method=lime"), "attribution.method"),
    CliCase("attribution", ("recipe=explain", "attribution.select=fc2"), "attribution.select"),
    CliCase(
        "distill", ("recipe=prune_distill_digits", "finetune.distill.features=[conv9]"), "finetune.distill.features"
    ),
    CliCase(
        "distill", ("recipe=prune_distill_digits", "finetune.distill.temperature=0"), "finetune.distill.temperature"
    ),
    CliCase("rotate", (*FAST, "steps=[rotate]", "+rotate={online: true}"), "rotate.online"),
    CliCase("rotate", (*FAST, "steps=[rotate]", "+rotate={}"), "rotate"),
    CliCase("kv-cache", (*FAST, "steps=[kv_cache]", "+kv_cache={}"), "kv_cache"),
    CliCase("kv-cache", (*FAST, "steps=[kv_cache]", "+kv_cache={dynamic: token}"), "kv_cache.per_channel"),
    CliCase(
        "rewrite-name", (*REWRITE, "rewrite.name=melt", "~rewrite.kwargs.mean", "~rewrite.kwargs.std"), "rewrite.name"
    ),
    CliCase(
        "rewrite-name",
        (*REWRITE, "rewrite.name=no_such.module.fn", "~rewrite.kwargs.mean", "~rewrite.kwargs.std"),
        "rewrite.name",
    ),
    CliCase("unknown-key", (*FAST, "prune.amountt=0.3"), "prune.amountt"),
    CliCase("build-rule", ("recipe=swap_activations", *FAST, "build.0.to=torch.nn.Nope"), "build[0].to"),
    CliCase("build-rule", ("recipe=swap_activations", *FAST, "build.0.kind=melt"), "kind"),
    CliCase("build-rule", ("recipe=swap_activations", *FAST, "build.0.match=[]"), "build[0].match"),
    CliCase("choice", (*FAST, "checks.enabled=[identity,nope]"), "checks.enabled"),
    CliCase("choice", (*FAST, "output.checkpoint=onnx"), "output.checkpoint"),
    CliCase("selection", (*FAST, "prune.select=[layer9.*]"), "prune.select"),
    CliCase("selection", (*FAST, "prune.exclude=[fcc]"), "prune.exclude"),
    CliCase("selection", (*QUANTIZE, "quantize.select=[nope]"), "quantize.select"),
    CliCase("selection", (*REWRITE, "rewrite.select=[nope]"), "rewrite.select"),
    CliCase("per-channel", (*QUANTIZE, "quantize.select=[bn1]"), "per_channel"),
    CliCase("duplicate", (*FAST, "steps=[prune,prune]"), "steps"),
    CliCase("checkpoint", FAST, "model.weights", resnet18_checkpoint("missing")),
    CliCase("checkpoint", FAST, "model.weights", resnet18_checkpoint("truncated")),
    CliCase("checkpoint", FAST, "model.weights", resnet18_checkpoint("truncated_safetensors")),
    CliCase("checkpoint", FAST, "model.weights", resnet18_checkpoint("wrong")),
    CliCase("checkpoint", FAST, "model.weights", resnet18_checkpoint("code")),
    CliCase("nonfinite-weights", FAST, "prune.select='layer1.0.conv1.weight'", resnet18_checkpoint("nan")),
    CliCase("checkpoint-dtype", FAST, "model.weights", int32_resnet18),
    CliCase("huge-number", (*FAST, f"prune.amount={HUGE}"), "prune.amount='a 401-digit integer'"),
    CliCase("huge-number", (*FAST, f"seed={'9' * 23}"), "seed='a 23-digit integer'"),
    CliCase("huge-number", (*FAST, f"data.seed=-{'9' * 23}"), "data.seed="),
    CliCase("huge-number", (*REWRITE, f"rewrite.kwargs.std=[1,1,{HUGE}]"), "rewrite.kwargs.std.2="),
    CliCase("import-path", (*FAST, "prune.select=[type:..x.Y]"), "prune.select='type:..x.Y'"),
    CliCase("import-path", (*REWRITE, "rewrite.name=..a.b"), "rewrite.name='..a.b'"),
    CliCase("import-path", ("recipe=swap_activations", *FAST, "build.0.to=..a.b"), "build[0].to='..a.b'"),
    CliCase(
        "import-path",
        (*REWRITE, "rewrite.name=os.system", "~rewrite.kwargs.mean", "~rewrite.kwargs.std"),
        "rewrite.name='os.system'",
    ),
    CliCase(
        "import-path",
        (*REWRITE, "rewrite.name=fails_on_import.fn", "~rewrite.kwargs.mean", "~rewrite.kwargs.std"),
        "rewrite.name='fails_on_import.fn'",
        user_module("fails_on_import", "raise RuntimeError('broken at import')\n"),
    ),
    CliCase("interpolation", (*FAST, "prune.amount=${nope}"), "prune.amount: cannot be resolved"),
    CliCase("interpolation", (*FAST, "seed=${oc.env:SURGERY_UNSET_VARIABLE}"), "seed: cannot be resolved"),
    CliCase("override-syntax", (*FAST, "=0.5"), "'=0.5'"),
    CliCase("override-syntax", FAST, "broken.yaml, line 2: not valid YAML", broken_recipe),
    CliCase("too-large", (*FAST, "data.image_size=100000"), "data.image_size=100000"),
    CliCase("too-large", (*FAST, "model.num_classes=10000000000"), "model.name='resnet18': cannot be built"),
    CliCase("run-dir", FAST, "hydra.run.dir=", run_dir_at("file")),
    CliCase("run-dir", FAST, "hydra.run.dir='/dev/full'", run_dir_at("/dev/full")),
    CliCase("run-dir", FAST, "output=", patches={"surgery.core.checkpoints.save_file": disk_full_safetensors}),
    CliCase("regex", (*FAST, "prune.select=['re:(.*.*)*z']"), "prune.select='re:(.*.*)*z'"),
    CliCase(
        "empty-selection", (*QUANTIZE, "quantize.activations=null", "quantize.select=[type:ReLU]"), "quantize.select="
    ),
    CliCase("never-fired", ("recipe=swap_activations", *FAST, "build.0.match=type:GELU"), "build[0].match="),
    CliCase("unknown-key", (*FAST, "+prune.amountt=0.3"), "prune.amountt: not a setting here"),
    CliCase("originals-place", (*FAST, "+prune.originals=tape"), "prune.originals='tape': must be one of memory, disk"),
    CliCase(
        "float-format",
        (*QUANTIZE, "quantize.weights.format=fp8_e4m3", "+quantize.weights.group_size=7"),
        "quantize.weights.group_size=7: does not divide the",
    ),
    CliCase(
        "float-format", (*QUANTIZE, "quantize.weights.format=fp7"), "quantize.weights.format='fp7': must be one of"
    ),
    CliCase("gguf-mix", ("recipe=plan_llama", "plan.mix=Q4_K_S"), "plan.mix='Q4_K_S': must be one of Q4_K_M"),
    CliCase("device", (*QUANTIZE, "model.device=cuda:7"), "model.device='cuda:7': is not on this machine"),
    CliCase("device", (*QUANTIZE, "model.device=tpu"), "model.device='tpu': must be cpu, cuda, cuda:N or mps"),
    CliCase("device", (*QUANTIZE, "model.dtype=float8"), "model.dtype='float8': must be one of float32, bfloat16"),
    CliCase(
        "onload",
        (*QUANTIZE, "+quantize.onload=cuda:7"),
        "quantize.onload='cuda:7': is not on this machine",
    ),
    CliCase("onload", (*QUANTIZE, "+quantize.onload=cpu"), "quantize.onload='cpu': moves each block to a device"),
    CliCase(
        "float-offset",
        (*QUANTIZE, "+quantize.weights.float_offset=true"),
        "quantize.weights.float_offset=True: applies to affine grids (symmetric=false)",
    ),
    CliCase(
        "super-group",
        (*QUANTIZE, "+quantize.weights.group_size=16", "+quantize.weights.super_group=100"),
        "quantize.weights.super_group=100: and scale_bits are set together",
    ),
    CliCase("owl", (*FAST, "+prune.owl={lam: 0.6}"), "prune.owl.lam=0.6: moves a block's sparsity outside [0, 1]"),
    CliCase(
        "owl", (*FAST, "+prune.owl={}", "prune.scope=global"), "prune.owl={'lam': 0.08, 'm': 5.0}: plans each block"
    ),
    CliCase("activation-budget", (*FAST, "data.activation_budget=-1"), "data.activation_budget=-1: must be null"),
    CliCase(
        "activation-budget", (*FAST, "data.activation_folder=/no/such"), "data.activation_folder='/no/such': must be"
    ),
    CliCase("nonfinite-weights", QUANTIZE, "quantize.weights='layer1.0.conv1.weight'", resnet18_checkpoint("nan")),
    CliCase(
        "offload",
        ("recipe=quantize_gptq_llama", "model.path=null", "model.offload=true"),
        "model.offload=True: needs model=hf",
    ),
    CliCase(
        "offload",
        ("recipe=quantize_gptq_llama", "model.offload=true", "steps=[shrink]", "+shrink={}"),
        "steps='shrink': does not run on an offloaded model",
        lambda folder: (f"model.path={llama_folder(folder)}",),
    ),
    CliCase("offload-folder", OFFLOAD, "offloaded.source='", offload_folder("architectures")),
    CliCase("offload-folder", OFFLOAD, "model.path='", offload_folder("code")),
    CliCase("offload-folder", OFFLOAD, "quantize/manifest.json': is not a manifest", offload_folder("manifest")),
    CliCase(
        "export-options",
        ("recipe=quantize_digits", "export.format=onnx", "+export.options.opset=x"),
        "export.options.opset='x': must be an integer from 18 to 25",
    ),
    CliCase(
        "export-options",
        ("recipe=quantize_digits", "export.format=onnx", "+export.options.weights=int4"),
        "export.options.weights='int4': must be uint8 or int8",
    ),
    CliCase("export-write", (*FAST, "+export.options={tokenizer: tok}"), "export.options={'tokenizer': 'tok'}"),
    CliCase(
        "export-write",
        (*LLAMA_RTN, "export.format=compressed-tensors", "+export.options.max_shard_size=banana"),
        "export.options.max_shard_size='banana'",
    ),
    CliCase("attribution", ("recipe=explain", "attribution.target=1.5"), "attribution.target=1.5"),
    CliCase("coverage-bound", (*FAST, "checks.max_untouched=2"), "checks.max_untouched=2"),
    CliCase(
        "offload",
        ("recipe=quantize_gptq_llama", "model.offload=true", "quantize.method=rtn"),
        "model.offload_folder=",
        lambda folder: (f"model.path={llama_folder(folder)}", f"model.offload_folder={a_file(folder)}"),
    ),
    CliCase(
        "run-dir",
        (*FAST, "output.checkpoint=pt"),
        "model.pt': cannot be written (",
        patches={"torch.save": disk_full_torch_save},
    ),
    CliCase(
        "actorder",
        (*LLAMA_RTN, "quantize.method={name: gptq, actorder: dynamic}"),
        "quantize.method.actorder='dynamic'",
    ),
    CliCase(
        "experts-amount",
        ("recipe=prune_experts_moe", "prune_experts.amount=7", "prune_experts.calibration_batches=1", "data.batches=1"),
        "prune_experts.amount=7: leaves 1 expert per layer",
    ),
    CliCase(
        "autoround-iterations",
        ("recipe=quantize_gptq_llama", "quantize.method={name: autoround, iterations: 0}"),
        "quantize.method.iterations=0",
    ),
    CliCase(
        "plan-budget",
        ("recipe=plan_llama", "budget=1bpw", "plan.calibration_batches=1", "data.batches=1"),
        "plan.budget='1bpw': no plan fits; smallest reachable:",
    ),
    CliCase("plan-budget", ("recipe=plan_llama", "budget=lots"), "plan.budget='lots': must be bytes"),
    CliCase("plan-budget", ("recipe=plan_llama", "budget=1e400bpw"), "plan.budget='1e400bpw': must be bytes"),
    CliCase(
        "plan-kv",
        ("recipe=plan_llama", "plan.choices=[dense,w4g128,kv16,kv_int8]", "plan.kv_tokens=4096"),
        "plan.budget='4.5bpw': must be bytes (e.g. '12MB') when the plan counts a KV cache as well as weights",
    ),
    CliCase("rotate-learn", (*LLAMA_RTN, "steps=[rotate,quantize]", "+rotate={learn: {lr: 0}}"), "rotate.learn.lr=0"),
    CliCase(
        "full-range",
        (*LLAMA_RTN, "quantize.weights.observer=full_range", "quantize.weights.symmetric=true"),
        "quantize.weights.observer='full_range': is symmetric about zero on an affine integer grid",
    ),
    CliCase(
        "imatrix-mse",
        ("recipe=quantize_gptq_llama", "quantize.method=autoround", "quantize.weights.observer=imatrix_mse"),
        "quantize.weights.observer='imatrix_mse': weighs the clipping search of methods that pick scales",
    ),
]


def a_file(folder: Path) -> Path:
    """A plain file where a folder is expected."""
    (folder / "a_file").write_text("not a folder")
    return folder / "a_file"


def llama_folder(folder: Path) -> Path:
    """A small random Llama saved as Hugging Face saves it."""
    from support import tiny_llama  # tests/support.py

    tiny_llama(layers=2).save_pretrained(folder / "llama")
    return folder / "llama"


def written(folder: Path) -> list[str]:
    """Files in a run folder other than Hydra's own record (.hydra/, the job log)."""
    if not folder.exists():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name != ".hydra" and p.suffix != ".log")


@pytest.mark.parametrize("case", CLI_CASES, ids=str)
def test_cli_exits_2_with_one_line_naming_the_field_and_writes_nothing(case: CliCase, tmp_path: Path):
    extra = case.setup(tmp_path) if case.setup else ()
    out = tmp_path / "out"
    own_dir = any(a.startswith("hydra.run.dir=") for a in extra)
    with contextlib.ExitStack() as patched:
        for target, replacement in case.patches.items():
            patched.enter_context(mock.patch(target, replacement))
        result = run_cli(*case.args, *extra, *(() if own_dir else (f"hydra.run.dir={out}",)), pythonpath=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()  # splitlines also splits at a progress bar's "\r"
    assert len(lines) == 1 and lines[0].startswith("surgery: error: "), result.stderr[-2000:]
    assert case.field in lines[0] and "Traceback" not in result.stderr, lines[0]
    assert "=None:" not in lines[0]
    assert written(out) == [] and not list(tmp_path.glob("**/.staging-*"))


def test_cli_never_overwrites_an_existing_output_silently(tmp_path: Path):
    assert run_cli(*FAST, f"hydra.run.dir={tmp_path}").returncode == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    again = run_cli(*FAST, "prune.amount=0.9", f"hydra.run.dir={tmp_path}")
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1
    assert "output=" in again.stderr and "output.overwrite=true" in again.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.suffix != ".log"} == {
        k: v for k, v in before.items() if not k.endswith(".log")
    }
    assert run_cli(*FAST, "prune.amount=0.9", "output.overwrite=true", f"hydra.run.dir={tmp_path}").returncode == 1


def test_cli_sweep_rerun_into_the_same_folder_changes_nothing(tmp_path: Path):
    # both from one folder: Hydra's multirun.yaml records the working folder
    first = run_cli("-m", *FAST, "prune.amount=0.2,0.6", f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".log" and ".hydra" not in p.parts)
    before = {p: p.read_bytes() for p in files}
    again = run_cli("-m", *FAST, "prune.amount=0.2,0.6", f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-2000:]
    errors = again.stderr.strip().splitlines()
    assert errors and all(line.startswith("surgery: error: output=") for line in errors), again.stderr
    assert {p: p.read_bytes() for p in files} == before


# ------------------------------------------------------------------------------ the table


def test_readme_table_and_these_cases_list_the_same_rows():
    rows = table_ids()
    assert len(rows) == len(set(rows)), "a row id appears twice in the table"
    tested = {case.row for case in API_CASES} | {case.row for case in CLI_CASES}
    assert set(rows) == tested
