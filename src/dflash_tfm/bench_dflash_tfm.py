"""`python -m dflash_tfm.bench_dflash_tfm`: the original system's harness name (see bench/harness.py)."""
from dflash_tfm.bench.harness import main

if __name__ == "__main__":
    main()
