"""What a quantized model stores: bits per quantized weight and the model's bytes against fp32."""

from __future__ import annotations

from typing import Any

from surgery.ops.numerics.grid import GridSpec

SCALE_BITS = 16  # a scale stored in half precision (compressed-tensors, GGUF); the MX/NV formats' block scales are 8
MICRO_SCALED = ("mxfp4", "nvfp4")


def element_bits(spec: GridSpec) -> int:
    """Bits of one quantized value on ``spec``'s grid."""
    return spec.number_format.bits if spec.is_float else spec.bits


def scale_bits(spec: GridSpec) -> int:
    """Bits of one scale (and its zero point, for an affine integer grid)."""
    scale = 8 if spec.format in MICRO_SCALED else SCALE_BITS
    return scale + (8 if not (spec.symmetric or spec.is_float) else 0)


def weight_storage(handle: Any) -> dict[str, Any]:
    """Of a quantize handle's model: the quantized weights' bits per weight (values and scales),
    and the bytes of every parameter (the others at their own dtype) against fp32.

    Example:
        >>> weight_storage(surgery.quantize(model, weights=GridSpec(bits=4, group_size=128)))["bits_per_weight"]
        4.125
    """
    model = handle.model
    parameters = {id(p): p for p in model.parameters()}
    quantized_bits = quantized = 0
    done: set[int] = set()
    for key, quantizer in handle.weights.items():
        param = model.get_parameter(key)
        spec = quantizer.spec
        quantized_bits += param.numel() * element_bits(spec) + quantizer.scale.numel() * scale_bits(spec)
        quantized += param.numel()
        done.add(id(param))
    other_bits = sum(p.numel() * p.element_size() * 8 for i, p in parameters.items() if i not in done)
    total = sum(p.numel() for p in parameters.values())
    stored = (quantized_bits + other_bits) / 8
    return {
        "weights": len(handle.weights),
        "share_of_parameters": quantized / max(total, 1),
        "bits_per_weight": quantized_bits / max(quantized, 1),
        "bytes": int(stored),
        "bytes_fp32": total * 4,
        "bytes_vs_fp32": stored / max(total * 4, 1),
    }
