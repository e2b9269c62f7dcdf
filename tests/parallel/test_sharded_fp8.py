"""FP8 block-quantized targets at tensor-parallel size 2 (gloo): each rank reads its slices of the FP8 weights
with the matching slices of their block scales, and the logits equal the tp 1 FP8 model's. Dimensions are
chosen so that every row-parallel column slice spans whole 128-column blocks, as at released sizes; a split
that cuts a block is refused, naming the tensor."""
from __future__ import annotations

import math

import pytest
import torch

from dflash_tfm.errors import CheckpointError
from dflash_tfm.layers.fp8_weight import Fp8Weight
from dflash_tfm.loading.fp8_layout import slice_row_scales
from dflash_tfm.loading.loader import load_model, open_checkpoint
from dflash_tfm.parallel.sharding import Shard

from ..loading.checkpoint_edits import quantize_checkpoint
from ..models.tiny_targets import VOCAB, fuse_experts
from .ranks import run_ranks
from .test_sharded_logits import passes, rel_err


COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)


def save_fp8(arch: str, root, fused: bool = False):
    """A random target whose row-parallel inputs split into 128-column halves at tp 2 (o_proj: 4 heads × 64; the
    MLP's and every expert's down_proj: 256; the GDN's out_proj: 4 value heads × 64), in the FP8 release format."""
    import transformers as tf

    torch.manual_seed(0)
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, intermediate_size=256, num_hidden_layers=2))
    else:  # the MoE hybrid of Qwen3.5-397B-A17B, at toy size
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(
            **COMMON, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
            shared_expert_intermediate_size=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}))
    path = root / arch
    model.eval().save_pretrained(path, safe_serialization=True)
    if fused:
        path = fuse_experts(path, root / "fused")
    return quantize_checkpoint(path, root / "fp8")


def fp8_rows(rank: int, tp: int, path: str, whole_experts: bool = False) -> dict[str, tuple[int, ...]]:
    source, raw, _ = open_checkpoint(path)
    model, _ = load_model(source, raw, torch.device("cpu"), torch.float32, 512, progress=False,
                          shard=Shard(rank, tp, experts=whole_experts))
    return {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, Fp8Weight)}


@pytest.mark.parametrize("arch, fused, whole_experts", [
    ("llama", False, False), ("qwen3_5_moe_text", False, False), ("qwen3_5_moe_text", True, False),
    ("qwen3_5_moe_text", False, True), ("qwen3_5_moe_text", True, True)])
def test_fp8_target_at_tp2_matches_tp1(arch: str, fused: bool, whole_experts: bool, tmp_path) -> None:
    """Each rank holds half the FP8 bytes, as slices of every expert or (expert parallelism) half the experts
    whole, with their scales."""
    path = str(save_fp8(arch, tmp_path, fused))
    whole = fp8_rows(0, 1, path)
    split = run_ranks(2, fp8_rows, path, whole_experts)
    assert whole and split[0].keys() == whole.keys()  # the same projections held in FP8, each a rank's slice
    held = [sum(math.prod(s) for s in shapes.values()) for shapes in (split[0], whole)]
    assert 0.5 <= held[0] / held[1] < 0.51  # half, but for the replicated router rows fused into a projection
    if whole_experts:
        assert {s[0] for n, s in split[0].items() if n.endswith("experts_gate_up")} == {2}  # 2 of 4 experts
    expected = passes(0, 1, path)
    ranks = run_ranks(2, passes, path, whole_experts)
    for name, logits in expected.items():
        assert rel_err(ranks[0][name], logits) <= 1e-5, name
        assert torch.equal(ranks[1][name], ranks[0][name]), f"{name}: the ranks disagree"


def test_scales_follow_row_slices_and_whole_column_blocks() -> None:
    scales = torch.arange(2 * 256 * 3, dtype=torch.float32).view(2, 256, 3)  # [experts, rows, column blocks]
    rows = slice_row_scales(scales, (1, ((10, 20), (200, 5))), "w", 384)
    assert torch.equal(rows, torch.cat([scales[:, 10:30], scales[:, 200:205]], dim=1))
    assert torch.equal(slice_row_scales(scales, (2, ((128, 256),)), "w", 384), scales[:, :, 1:])
    assert torch.equal(slice_row_scales(scales, (-1, ((256, 100),)), "w", 356), scales[:, :, 2:])  # ends at K
    with pytest.raises(CheckpointError, match="'w'.*columns 64 … 191.*128-column blocks"):
        slice_row_scales(scales, (2, ((64, 128),)), "w", 384)
