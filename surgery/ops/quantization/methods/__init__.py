"""Weight quantization methods, one file each, registered through ``surgery.register_weight_method``: rtn, gptq, gptaq, autoround."""

from surgery.ops.quantization.methods import autoround, gptaq, gptq, rtn  # noqa: F401 - they register themselves
