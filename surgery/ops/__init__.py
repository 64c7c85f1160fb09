"""The operations, one package a family, lowest first (``tests/test_layout.py`` holds the order):

- ``numerics``: the grid spec and observers, number formats, the weight-method contract, the
  grids and masks handed to export;
- ``build`` and ``experts``: ``intercept`` and its rules; a mixture-of-experts layer's experts
  as layers of their own, their scores and pruning;
- ``second_order``: Hessians and the GPTQ/SparseGPT walk;
- ``shrink`` and ``offload``: physical shrinking; models larger than memory;
- ``sparsity`` and ``equivalence``: pruning; SmoothQuant, AWQ, rotations, BatchNorm folding;
- ``quantization``: the verb, quantizers, QAT, placement, deploy targets, the KV cache and
  ``methods/`` (one file per weight method);
- ``training``, ``export``, ``sensitivity``, ``rewrite``: recovery; formats (``formats/gguf/``
  for llama.cpp); scans; inputs;
- ``planning``: a choice per layer within one budget, and llama.cpp's mixes as plans.

Every verb is declared through one door, :mod:`surgery.core.verbs` (a frozen spec and a
handler). A family imports only families below it (lazy imports included).
"""
