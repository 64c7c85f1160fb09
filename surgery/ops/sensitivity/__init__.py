"""Per-layer sensitivity scans and the amounts they give for a target sparsity."""
