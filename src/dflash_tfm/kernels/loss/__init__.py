"""Training-loss kernels (the drafter's cross-entropy over the target's vocabulary) and their PyTorch twins."""
