"""Published model shapes, as HF-style config dicts, for real-scale timing and tuning with random weights."""
from __future__ import annotations

_S, _F = "sliding_attention", "full_attention"

# Qwen3.6-27B text model (MODELS.md): 64 layers = 16 x (3 Gated DeltaNet + 1 gated attention).
QWEN3_6_27B: dict = {
    "model_type": "qwen3_5_text",
    "hidden_size": 5120,
    "num_hidden_layers": 64,
    "full_attention_interval": 4,
    "intermediate_size": 17408,
    "vocab_size": 248320,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
}

# Qwen3.5-35B-A3B text model (transformers' `Qwen3_5MoeTextConfig` defaults; Qwen3.6-35B-A3B has the same
# shapes): 40 layers = 10 x (3 Gated DeltaNet + 1 gated attention), every feed-forward a mixture of 256 experts of
# width 512, top-8, renormalised, plus a shared expert of width 512; no dense MLP. RoPE theta and context length as
# released (transformers' defaults are 10000 and 32768), like the 27B above.
QWEN3_5_35B_A3B: dict = {
    "model_type": "qwen3_5_moe_text",
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "full_attention_interval": 4,
    "vocab_size": 248320,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
}

# z-lab/Qwen3.6-27B-DFlash, its drafter (MODELS.md): 1.73B parameters besides the target's embeddings and lm_head.
QWEN3_6_27B_DFLASH: dict = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 5,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 17408,
    "rms_norm_eps": 1e-6, "rope_theta": 10_000_000.0, "layer_types": [_S, _S, _S, _S, _F], "sliding_window": 2048,
    "use_sliding_window": True,
    "num_target_layers": 64, "block_size": 16,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
}

# z-lab/Qwen3.6-35B-A3B-DFlash, the drafter of the MoE target above: 6 layers (5 sliding-window, 1 full), eight
# tap layers and a mask token of its own.
QWEN3_6_35B_A3B_DFLASH: dict = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 2048, "num_hidden_layers": 6,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144,
    "rms_norm_eps": 1e-6, "rope_theta": 10_000_000.0, "layer_types": [_S] * 5 + [_F], "sliding_window": 4096,
    "use_sliding_window": True, "num_target_layers": 40, "block_size": 16,
    "dflash_config": {"mask_token_id": 248077, "target_layer_ids": [1, 6, 11, 16, 22, 27, 32, 37]},
}

# The published Weaver (variant 1), as `spec.weaver_fixtures.write_random_weaver_checkpoint` arguments (plus K).
PUBLISHED_WEAVER: dict = {"variant": 1, "d_rank": 2048, "num_heads": 16, "mlp_dim": 2048, "num_layers": 1, "pool": 512}

# SmolLM2-135M-Instruct (the embedded default target), for timing training steps without its GGUF.
SMOLLM2_135M: dict = {
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rope_theta": 100_000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
