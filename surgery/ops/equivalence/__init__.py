"""Function-preserving transforms: SmoothQuant, AWQ, Hadamard rotations, BatchNorm folding."""
