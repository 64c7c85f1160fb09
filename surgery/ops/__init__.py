"""The operations, one package a family, lowest first (``tests/test_layout.py`` holds the order):

- ``numerics``: the grid spec and observers, number formats, the weight-method contract, the
  grids and masks handed to export;
- ``build``: ``intercept`` and its rules;
- ``second_order``: Hessians and the GPTQ/SparseGPT walk;
- ``shrink`` and ``offload``: physical shrinking; models larger than memory;
- ``sparsity`` and ``equivalence``: pruning; SmoothQuant, AWQ, rotations, BatchNorm folding;
- ``quantization``: the verb, quantizers, QAT, placement, deploy targets, the KV cache and
  ``methods/`` (one file per weight method);
- ``training``, ``export``, ``sensitivity``, ``rewrite``: recovery; formats; scans; inputs.

A family imports only families below it (lazy imports included).
"""
