"""GGUF, llama.cpp's format: its block types (``blocks``), the decoder families it holds
(``models``), tensors and metadata (``entries``, ``tokenizer``, ``sentencepiece``), the
per-tensor type mixes (``mix_types``), the writer registered as ``format="gguf"`` (``file``) and
the llama.cpp runtime that loads what it wrote (``llama_cpp_runtime``, run in a worker)."""

from surgery.ops.export.formats.gguf import file  # noqa: F401 - registers format="gguf"
