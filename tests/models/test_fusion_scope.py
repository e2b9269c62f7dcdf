"""Which calls the inductor-fused helpers compile: every decode / verify / drafter-block shape, no prefill chunk."""
import pytest
import torch

from dflash_tfm.layers.compile import small_enough_to_fuse


@pytest.mark.parametrize("shape", [
    (1, 1, 5120),          # decode hidden
    (1, 65, 24, 256),      # verify q of a 65-node tree (1560 per-head rows)
    (1, 129, 48, 128),     # verify GDN output of a 129-node tree, before the gated norm
    (1, 16, 32, 128),      # drafter block q
    (8,),                  # Weaver round: node slots
])
def test_decode_verify_and_draft_shapes_fuse(shape):
    assert small_enough_to_fuse(torch.empty(shape, device="meta"))


@pytest.mark.parametrize("shape", [(1, 2048, 5120), (1, 600, 24, 256), (2, 300, 5120)])
def test_prefill_chunks_stay_eager(shape):
    assert not small_enough_to_fuse(torch.empty(shape, device="meta"))
