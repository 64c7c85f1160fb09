"""Mixture-of-experts layers: how fused experts are stored (``layouts``), each expert as plain
``nn.Linear`` layers computing the same (``linear_experts``), and the swap a verb owns (``linearizing``)."""
