"""llm-compressor 0.14's GPTQ on one layer, run in its own virtual environment by
``test_reference_parity.py`` (it pins torch <= 2.14.0)::

    benchmarks/.venv-llmcompressor/bin/python tests/ops/second_order/llmcompressor_gptq_layer.py IN OUT

``IN`` is a ``torch.save`` of ``{"weight", "hessian", "bits", "group_size", "actorder"}``; ``OUT``
receives ``{"weight": quantized, "scale": (outputs, groups)}``. The grid is compressed-tensors'
asymmetric min-max one per group, observed on the weight before the walk, as ``GPTQModifier``
does.
"""

from __future__ import annotations

import sys

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from compressed_tensors.quantization.utils import calculate_qparams
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight


def main(source: str, target: str) -> None:
    given = torch.load(source)
    weight, hessian, size = given["weight"], given["hessian"], given["group_size"]
    args = QuantizationArgs(
        num_bits=given["bits"],
        type="int",
        symmetric=False,
        strategy=QuantizationStrategy.GROUP,
        group_size=size,
        actorder=given["actorder"],
    )
    groups = weight.reshape(weight.shape[0], -1, size)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    quantized, _, _ = quantize_weight(weight[None], hessian[None], scale[None], zero_point[None], None, args)
    torch.save({"weight": quantized[0], "scale": scale}, target)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
