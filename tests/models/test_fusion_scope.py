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


def test_row_counted_helpers_fuse_by_rows():
    """`count_rows`: a [rows, features] input (the Weaver prefix: K + 1 = 16 rows of the 5120-wide target hidden)
    fuses by its rows, where counting its first two dims would call it 81920 tokens; a long one stays eager."""
    prefix = torch.empty(16, 5120, device="meta")
    assert not small_enough_to_fuse(prefix)
    assert small_enough_to_fuse(prefix, count_rows=True)
    assert not small_enough_to_fuse(torch.empty(4096, 2048, device="meta"), count_rows=True)
