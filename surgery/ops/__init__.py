"""The operations: prune, quantize, rewrite, intercept and its rules."""
