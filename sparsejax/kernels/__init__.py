"""GPU kernels, one folder per op (contract + reference, one file per backend)."""
