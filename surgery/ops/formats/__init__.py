"""Moved to :mod:`surgery.ops.export.formats`: this old path (and its modules) warns and goes away
in 0.4."""

import importlib
import sys
import warnings

from surgery.ops.export import formats as _moved

warnings.warn(
    "surgery.ops.formats moved to surgery.ops.export.formats; the old path goes away in 0.4",
    DeprecationWarning,
    stacklevel=2,
)
for _name in (
    "compressed_tensors_folder",
    "fp8_linear",
    "onnx_qdq",
    "requirements",
    "sparse_linear",
    "torchao_tensors",
):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"{_moved.__name__}.{_name}")
sys.modules[__name__] = _moved
