"""llm-compressor 0.14's ``mse`` observer search on rows of values, run in its own virtual
environment by ``test_searched_ranges.py``::

    benchmarks/.venv-llmcompressor/bin/python tests/ops/numerics/llmcompressor_mse_ranges.py IN OUT

``IN`` is a ``torch.save`` of ``{"rows": (rows, values), "bits", "symmetric"}``; ``OUT`` receives
``{"low", "high"}``, one per row (each row one channel's group of values).
"""

from __future__ import annotations

import sys

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from llmcompressor.observers.mse_quant import _grid_search_mse


def main(source: str, target: str) -> None:
    given = torch.load(source)
    rows = given["rows"]
    args = QuantizationArgs(
        num_bits=given["bits"], type="int", symmetric=given["symmetric"], strategy=QuantizationStrategy.CHANNEL
    )
    token = args.model_copy(update={"strategy": QuantizationStrategy.TOKEN})
    low, high = _grid_search_mse(rows.unsqueeze(0), args, token, 0.20, 5, 100.0, 2.4, 0.30)
    torch.save({"low": low, "high": high}, target)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
