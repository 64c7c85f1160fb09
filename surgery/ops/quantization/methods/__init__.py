"""Weight quantization methods, one file each, registered through ``surgery.register_weight_method``: rtn, gptq, gptaq."""

from surgery.ops.quantization.methods import gptaq, gptq, rtn  # noqa: F401 - they register themselves
