"""GGUF reading: parity with transformers on the real SmolLM2 file, synthetic quantized files, bad input."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_tfm.loading.default_model import default_model_path
from dflash_tfm.errors import CheckpointError, CheckpointNotFoundError
from dflash_tfm.loading.gguf_file import GGUFCheckpoint, load_gguf_tokenizer, open_gguf

TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "héllo wörld 日本語 🙂 — tabs\tand\nnewlines\n\n",
    "def f(x):\n    return x ** 2  # 1234567",
    "<|im_start|>user\nhi<|im_end|>",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]


# ---------------------------------------------------------------- real SmolLM2 file vs transformers


@pytest.fixture(scope="module")
def smol_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def smol(smol_path: Path) -> GGUFCheckpoint:
    return open_gguf(smol_path)


@pytest.fixture(scope="module")
def hf_model(smol_path: Path) -> torch.nn.Module:
    """transformers' own GGUF load of the same file: the reference (slow, so once per module)."""
    return AutoModelForCausalLM.from_pretrained(
        str(smol_path.parent), gguf_file=smol_path.name, dtype=torch.float32, local_files_only=True
    )


def test_default_model_path(smol_path: Path) -> None:
    assert smol_path.is_file() and smol_path.suffix == ".gguf"


@pytest.mark.slow
def test_tensors_match_transformers(smol: GGUFCheckpoint, hf_model: torch.nn.Module) -> None:
    reference = hf_model.state_dict()
    names = smol.tensor_names()
    assert len(names) == 272 and "lm_head.weight" not in names  # tied: file has no output.weight
    assert set(names) == set(reference) - {"lm_head.weight"}
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    for name in names:
        ours = smol.load_tensor(name)
        assert ours.dtype == torch.float32
        assert tuple(ours.shape) == smol.tensor_shape(name) == tuple(reference[name].shape), name
        assert (ours - reference[name]).abs().max().item() <= 1e-6, name  # in practice bit-identical
    assert smol.quant_type("model.layers.0.self_attn.q_proj.weight") == "Q4_1"
    assert smol.quant_type("model.embed_tokens.weight") == "Q8_0"


@pytest.mark.slow
def test_config_matches_transformers(smol: GGUFCheckpoint, hf_model: torch.nn.Module) -> None:
    ours, ref = smol.config, hf_model.config
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert ours[key] == getattr(ref, key), key
    assert ours["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert (ours["hidden_size"], ours["num_hidden_layers"], ours["num_attention_heads"]) == (576, 30, 9)
    assert (ours["num_key_value_heads"], ours["vocab_size"], ours["tie_word_embeddings"]) == (3, 49152, True)


@pytest.mark.slow
def test_tokenizer_matches_transformers(smol_path: Path) -> None:
    ours = load_gguf_tokenizer(smol_path)
    ref = AutoTokenizer.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name, local_files_only=True)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == text
    assert ours.chat_template and "<|im_start|>" in ours.chat_template
    prompt = ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt == ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert ours.encode(prompt) == ref.encode(prompt)
    # Special tokens come from the metadata ids (transformers' converter puts bos where eos belongs).
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.eos_token == "<|im_end|>"


# ---------------------------------------------------------------- synthetic files

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 64, 96, 4, 2, 16, 32, 2


def _llamacpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`: the layout GGUF files store q/k in."""
    rows = weights.shape[0]
    return weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _hf_weights(arch: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        prefix = f"model.layers.{i}."
        shapes |= {
            prefix + "input_layernorm.weight": (HIDDEN,),
            prefix + "post_attention_layernorm.weight": (HIDDEN,),
            prefix + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            prefix + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            prefix + "mlp.gate_proj.weight": (FFN, HIDDEN),
            prefix + "mlp.up_proj.weight": (FFN, HIDDEN),
            prefix + "mlp.down_proj.weight": (HIDDEN, FFN),
        }
        if arch == "qwen3":
            shapes |= {prefix + "self_attn.q_norm.weight": (HEAD_DIM,), prefix + "self_attn.k_norm.weight": (HEAD_DIM,)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    base = hf_name.removesuffix(".weight")
    if base.startswith("model.layers."):
        layer, part = base.removeprefix("model.layers.").split(".", 1)
        return f"blk.{layer}.{_TO_GGUF[part]}.weight"
    return f"{_TO_GGUF[base]}.weight"


def _qtype(hf_name: str) -> QT:
    """Layer 0 in F32/F16, layer 1 in Q8_0/Q4_1, as a mixed llama.cpp quant would; norms stay F32."""
    if hf_name.endswith("norm.weight"):
        return QT.F32
    if ".layers.1." in hf_name:
        return QT.Q4_1 if "mlp" in hf_name or "q_proj" in hf_name else QT.Q8_0
    return QT.F16 if "mlp" in hf_name else QT.F32


def _write_gguf(path: Path, arch: str, weights: dict[str, np.ndarray], qtypes: dict[str, QT],
                raw: dict[str, np.ndarray] | None = None) -> None:
    """Write HF-named `weights` as llama.cpp would (GGUF names, q/k permuted for llama), plus `raw` GGUF tensors."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "qwen3":
        writer.add_key_length(HEAD_DIM)
    else:
        writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, values in weights.items():
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            values = _llamacpp_permute(values, HEADS if "q_proj" in name else KV_HEADS)
        qtype = qtypes[name]
        if qtype == QT.F32:  # written in the array's own dtype (float32, or int32 for the I32 case)
            writer.add_tensor(_gguf_name(name), values)
        elif qtype == QT.F16:
            writer.add_tensor(_gguf_name(name), values.astype(np.float16))
        else:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    for name, values in (raw or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _max_error(values: np.ndarray, qtype: QT) -> float:
    """Worst-case absolute error of the format over the whole tensor: half a quantization step, plus the
    fp16 rounding of the block scale (times up to 127 or 15 quanta) and of the Q4_1 block minimum."""
    amax, fp16_eps = float(np.abs(values).max()), 2.0**-11
    if qtype == QT.F32:
        return 0.0
    if qtype == QT.F16:
        return amax * fp16_eps
    if qtype == QT.Q8_0:
        step = amax / 127
        return step * (0.5 + 127 * fp16_eps) * 1.01
    step = float(values.max() - values.min()) / 15
    return step * (0.5 + 15 * fp16_eps) * 1.01 + amax * fp16_eps


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray], dict[str, QT]]:
    weights = _hf_weights("llama", np.random.default_rng(0))
    qtypes = {name: _qtype(name) for name in weights}
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    _write_gguf(path, "llama", weights, qtypes)
    return path, weights, qtypes


def test_synthetic_dequantize_and_unpermute(synthetic: tuple[Path, dict[str, np.ndarray], dict[str, QT]]) -> None:
    path, weights, qtypes = synthetic
    ckpt = open_gguf(path)
    assert set(ckpt.tensor_names()) == set(weights)
    assert {ckpt.quant_type(name) for name in weights} == {"F32", "F16", "Q8_0", "Q4_1"}
    for name, original in weights.items():
        loaded = ckpt.load_tensor(name).numpy()
        assert loaded.shape == original.shape, name
        assert ckpt.quant_type(name) == qtypes[name].name
        # Exactly gguf's own quantize->dequantize round trip (rows move as a whole, so un-permuting commutes) ...
        np.testing.assert_array_equal(loaded, gguf.quants.dequantize(gguf.quants.quantize(original, qtypes[name]),
                                                                      qtypes[name]).reshape(original.shape), name)
        # ... hence within the format's rounding error of the original.
        assert np.abs(loaded - original).max() <= _max_error(original, qtypes[name]), name
    # F32 q/k: the llama.cpp permutation round-trips exactly.
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        torch.testing.assert_close(ckpt.load_tensor(name), torch.from_numpy(weights[name]), rtol=0, atol=0)
    assert ckpt.load_tensor("model.norm.weight", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_synthetic_config(synthetic: tuple[Path, dict[str, np.ndarray], dict[str, QT]]) -> None:
    config = open_gguf(synthetic[0]).config
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (HIDDEN, FFN, LAYERS)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (HEADS, KV_HEADS,
                                                                                                  HEAD_DIM)
    assert (config["vocab_size"], config["tie_word_embeddings"], config["max_position_embeddings"]) == (VOCAB, True,
                                                                                                       256)
    assert (config["bos_token_id"], config["eos_token_id"], config["rope_theta"]) == (1, 2, 10000.0)


def test_untied_lm_head(tmp_path: Path) -> None:
    weights = _hf_weights("llama", np.random.default_rng(1))
    weights["lm_head.weight"] = np.random.default_rng(2).standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    _write_gguf(tmp_path / "untied.gguf", "llama", weights, {name: QT.F32 for name in weights})
    ckpt = open_gguf(tmp_path / "untied.gguf")
    assert ckpt.config["tie_word_embeddings"] is False
    assert "lm_head.weight" in ckpt.tensor_names()
    np.testing.assert_array_equal(ckpt.load_tensor("lm_head.weight").numpy(), weights["lm_head.weight"])


def test_qwen3_has_qk_norm_and_no_permutation(tmp_path: Path) -> None:
    weights = _hf_weights("qwen3", np.random.default_rng(3))
    _write_gguf(tmp_path / "qwen3.gguf", "qwen3", weights, {name: QT.F32 for name in weights})
    ckpt = open_gguf(tmp_path / "qwen3.gguf")
    assert ckpt.config["model_type"] == "qwen3" and ckpt.config["head_dim"] == HEAD_DIM
    assert "model.layers.1.self_attn.k_norm.weight" in ckpt.tensor_names()
    for name, original in weights.items():  # qwen files are stored unpermuted, read back as written
        np.testing.assert_array_equal(ckpt.load_tensor(name).numpy(), original, name)


# ---------------------------------------------------------------- bad input


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    for call in (open_gguf, load_gguf_tokenizer):
        with pytest.raises(FileNotFoundError, match="nope.gguf") as info:
            call(missing)
        assert isinstance(info.value, CheckpointNotFoundError)


@pytest.mark.parametrize("content", [b"", b"GG", b"not a gguf file at all, just text\n" * 10])
def test_not_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="fake.gguf.*not a valid GGUF"):
        open_gguf(path)


@pytest.mark.parametrize("fraction", [0.5, 0.95, 0.02])
def test_truncated(synthetic: tuple[Path, dict[str, np.ndarray], dict[str, QT]], tmp_path: Path,
                   fraction: float) -> None:
    data = synthetic[0].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(CheckpointError, match="cut.gguf.*corrupt or truncated"):
        open_gguf(path)


def test_directory_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a regular file"):
        open_gguf(tmp_path)


def _write_bare(path: Path, arch: str) -> Path:
    """A GGUF file of `arch` holding only an embedding (enough to be opened)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_arch(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"'mamba' is not supported \(supported: llama, qwen2, qwen3\)"):
        open_gguf(_write_bare(tmp_path / "mamba.gguf", "mamba"))


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_moe_and_hybrid_gguf_files_point_to_safetensors(tmp_path: Path, arch: str) -> None:
    """Qwen3.5-MoE and Qwen3-Next run from their safetensors directories; their GGUF files are refused by name."""
    with pytest.raises(CheckpointError, match=rf"'{arch}' .*not supported in GGUF format.*safetensors directory"):
        open_gguf(_write_bare(tmp_path / f"{arch}.gguf", arch))


def test_unsupported_quant_type(tmp_path: Path) -> None:
    weights = _hf_weights("llama", np.random.default_rng(4))
    weights["model.layers.1.mlp.up_proj.weight"] = np.zeros((FFN, HIDDEN), np.int32)  # stored as I32
    _write_gguf(tmp_path / "int.gguf", "llama", weights, {name: QT.F32 for name in weights})
    ckpt = open_gguf(tmp_path / "int.gguf")
    with pytest.raises(CheckpointError, match=r"blk\.1\.ffn_up\.weight .*stored as I32"):
        ckpt.load_tensor("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(KeyError, match="no tensor 'model.bogus'"):
        ckpt.load_tensor("model.bogus")


def test_unmapped_tensor_is_rejected(tmp_path: Path) -> None:
    weights = _hf_weights("llama", np.random.default_rng(5))
    raw = {"rope_freqs.weight": np.ones(HEAD_DIM // 2, np.float32)}  # llama-3.1 rope scaling factors
    _write_gguf(tmp_path / "rope.gguf", "llama", weights, {name: QT.F32 for name in weights}, raw)
    with pytest.raises(CheckpointError, match="no Hugging Face equivalent: rope_freqs.weight"):
        open_gguf(tmp_path / "rope.gguf")
