"""llm-compressor 0.14's ``imatrix_mse`` observer on one weight and its inputs' energy, run in
its own virtual environment by ``test_searched_ranges.py``::

    benchmarks/.venv-llmcompressor/bin/python tests/ops/numerics/llmcompressor_imatrix_ranges.py IN OUT

``IN`` is a ``torch.save`` of ``{"weight": (outputs, inputs), "energy": (inputs,), "bits",
"symmetric", "group_size"}`` (``energy``: each input's E[x²], as its forward hook sums it);
``OUT`` receives ``{"low", "high"}``, one per (output, group), output-major.
"""

from __future__ import annotations

import sys

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from llmcompressor.observers import Observer
from llmcompressor.observers.helpers import flatten_for_calibration


def main(source: str, target: str) -> None:
    given = torch.load(source)
    weight, size = given["weight"], given["group_size"]
    strategy = QuantizationStrategy.GROUP if size else QuantizationStrategy.CHANNEL
    args = QuantizationArgs(
        num_bits=given["bits"],
        type="int",
        symmetric=given["symmetric"],
        strategy=strategy,
        group_size=size,
        observer="imatrix_mse",
    )
    observer = Observer.load_from_registry("imatrix_mse", base_name="weight", args=args)
    observer._imatrix_sum = given["energy"].float()  # what its hook sums over one token
    observer._imatrix_count = torch.tensor(1)
    observer.update_statistics_from_observed(flatten_for_calibration(weight, "weight", args))
    torch.save({"low": observer.min_vals.reshape(-1), "high": observer.max_vals.reshape(-1)}, target)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
