"""Planning: one budget across every knob (a weight format, or N:M sparsity, per layer)."""
