"""Per-layer sensitivity scans and plans."""
