"""Tree-growth kernels of DFLASH_TFM (one Weaver round's bookkeeping) and their PyTorch twins."""
