"""Tensor parallelism over torch.distributed: the process group (`group.py`) and how a target's config and
checkpoint tensors are split across ranks (`sharding.py`). NCCL between GPUs, gloo between CPU processes."""
