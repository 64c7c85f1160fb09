"""The built-in formats, each registered through :func:`surgery.register_export_format` as a
user's format is (``safetensors`` first: the default, first in every list); the deployment
formats' runtimes (the ``deploy`` extra) are imported only when used."""

from surgery.ops.export.formats import safetensors_file  # noqa: F401

# isort: split
from surgery.ops.export.formats import (
    compressed_tensors_folder,  # noqa: F401
    fp8_linear,  # noqa: F401
    gguf,  # noqa: F401
    int4_linear,  # noqa: F401
    onnx_qdq,  # noqa: F401
    sparse_linear,  # noqa: F401
    torchao_tensors,  # noqa: F401
)
