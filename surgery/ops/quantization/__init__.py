"""Quantization: the verb, its quantizers, QAT, activation placement, deploy targets, the KV cache, and methods/ (one file per weight method)."""
