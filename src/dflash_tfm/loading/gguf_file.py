"""Read GGUF checkpoints as Hugging Face-named float tensors plus an HF-style config.

The engine's models are written against Hugging Face names and `config.json` fields, so a GGUF file is
presented in that vocabulary: tensors are renamed (`blk.0.attn_q.weight` ->
`model.layers.0.self_attn.q_proj.weight`), dequantized one at a time with the `gguf` package (the reader
memory-maps the file, so streaming a model never holds more than one dequantized tensor), and llama.cpp's
q/k row permutation is undone exactly as transformers' GGUF loader does (`LlamaTensorProcessor`).
"""

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from dflash_tfm.errors import CheckpointError, CheckpointNotFoundError
from dflash_tfm.parallel.sharding import Part, take_part

# GGUF `general.architecture` -> (HF model_type, HF architectures class). Only dense decoder-only models
# whose tensors map one-to-one onto HF names are supported.
_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHS)
# llama.cpp's names for the mixture-of-experts and Gated DeltaNet families the engine runs from safetensors only:
# their GGUF tensors (stacked `ffn_*_exps`, `ssm_*`) have no mapping here yet.
_SAFETENSORS_ONLY = {"qwen2moe", "qwen3moe", "qwen3next", "qwen35", "qwen35moe"}

# llama.cpp's convert_hf_to_gguf.py permutes q/k rows only for the llama family (its RoPE kernel is
# "normal" mode there, NEOX for qwen); transformers un-permutes only for GGUF arch "llama".
_PERMUTED_QK_ARCHS = frozenset({"llama"})

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_REQUIRED: Any = object()  # `metadata` default meaning "the key must be present"
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def _hf_name(gguf_name: str) -> str | None:
    """Hugging Face name of a GGUF tensor, or None when it has no counterpart in our model classes."""
    if match := _BLOCK_RE.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}" if part in _BLOCK_NAMES else None
    if match := _GLOBAL_RE.fullmatch(gguf_name):
        part, kind = match.groups()
        return f"{_GLOBAL_NAMES[part]}.{kind}" if part in _GLOBAL_NAMES else None
    return None


def _unpermute_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` (rows (head, 2, d/2) -> (head, d/2, 2)), as transformers'
    `LlamaTensorProcessor._reverse_permute_weights` does; works for weights and biases."""
    rows = weights.shape[0]
    return weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


class GGUFCheckpoint:
    """An opened GGUF file: HF-style config, HF tensor names, and per-tensor dequantizing loads.

    Create it with `open_gguf`, which turns reader failures into `CheckpointError`.
    """

    def __init__(self, path: Path, reader: GGUFReader) -> None:
        self.path = path
        self._reader = reader
        self.arch: str = self.metadata("general.architecture")
        if self.arch in _SAFETENSORS_ONLY:
            raise CheckpointError(
                f"{path}: GGUF architecture {self.arch!r} (mixture-of-experts or Gated DeltaNet hybrid) is not "
                "supported in GGUF format; load the model's Hugging Face safetensors directory instead"
            )
        if self.arch not in _ARCHS:
            raise CheckpointError(
                f"{path}: GGUF architecture {self.arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        self._tensors: dict[str, ReaderTensor] = {}
        unmapped = []
        for tensor in reader.tensors:
            hf_name = _hf_name(tensor.name)
            if hf_name is None:
                unmapped.append(tensor.name)
            else:
                self._tensors[hf_name] = tensor
        if unmapped:
            # e.g. llama-3.1 `rope_freqs.weight`: silently dropping it would give a subtly wrong model.
            raise CheckpointError(f"{path}: tensors with no Hugging Face equivalent: {', '.join(unmapped[:8])}")
        for required in ("model.embed_tokens.weight", "model.norm.weight"):
            if required not in self._tensors:
                raise CheckpointError(f"{path}: GGUF file has no {required} tensor")
        try:
            self.config: dict[str, Any] = self._build_config()
        except TypeError as exc:  # e.g. a per-layer list where a single number is expected
            raise CheckpointError(f"{path}: GGUF metadata has an unexpected value type ({exc})") from exc

    def metadata(self, key: str, default: Any = _REQUIRED) -> Any:
        """Value of a GGUF metadata key (str/int/float/bool/list); without a default a missing key is an error."""
        field = self._reader.get_field(key)
        if field is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.path}: GGUF metadata lacks required key {key!r}")
            return default
        return field.contents()

    def _build_config(self) -> dict[str, Any]:
        """HF `config.json` fields, mirroring transformers' GGUF_CONFIG_MAPPING for these archs."""
        arch = self.arch
        if self.metadata(f"{arch}.rope.scaling.type", "none") != "none":
            raise CheckpointError(f"{self.path}: RoPE scaling ({arch}.rope.scaling.type) is not supported")
        hidden = int(self.metadata(f"{arch}.embedding_length"))
        heads = int(self.metadata(f"{arch}.attention.head_count"))
        # key_length is explicit (qwen3); llama files give rope.dimension_count, which transformers uses.
        head_dim = self.metadata(f"{arch}.attention.key_length", None)
        if head_dim is None:
            head_dim = self.metadata(f"{arch}.rope.dimension_count", hidden // heads)
        model_type, hf_class = _ARCHS[arch]
        config: dict[str, Any] = {
            "architectures": [hf_class],
            "model_type": model_type,
            "hidden_size": hidden,
            "intermediate_size": int(self.metadata(f"{arch}.feed_forward_length")),
            "num_hidden_layers": int(self.metadata(f"{arch}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.metadata(f"{arch}.attention.head_count_kv", heads)),
            "head_dim": int(head_dim),
            "rms_norm_eps": float(self.metadata(f"{arch}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.metadata(f"{arch}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.metadata(f"{arch}.context_length")),
            # The embedding matrix is the ground truth the model is built from.
            "vocab_size": self.tensor_shape("model.embed_tokens.weight")[0],
            # transformers: tied exactly when the file has no `output.weight`.
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in self._tensors,
            "hidden_act": "silu",
            # load_tensor's default output dtype; the on-disk formats are quantized / mixed.
            "torch_dtype": "float32",
        }
        for kind in ("bos", "eos", "pad"):
            key = "padding" if kind == "pad" else kind
            token_id = self.metadata(f"tokenizer.ggml.{key}_token_id", None)
            if token_id is not None:
                config[f"{kind}_token_id"] = int(token_id)
        return config

    def tensor_names(self) -> list[str]:
        """HF names of all tensors in file order (`lm_head.weight` only when the file stores one)."""
        return list(self._tensors)

    def _tensor(self, name: str) -> ReaderTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {name!r}") from None

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """HF (row-major) shape; GGUF lists dimensions innermost first, so this is the reverse."""
        return tuple(int(dim) for dim in reversed(self._tensor(name).shape))

    def quant_type(self, name: str) -> str:
        """GGML storage type of a tensor, e.g. "Q4_1", "Q8_0", "F32"."""
        return self._tensor(name).tensor_type.name

    def tensor_dtype(self, name: str) -> str:
        """The GGUF storage type's name (Q4_1, F32, ...)."""
        return self._tensor(name).tensor_type.name

    def load_tensor(self, name: str, dtype: torch.dtype = torch.float32, part: Part | None = None) -> torch.Tensor:
        """Dequantize one tensor to `dtype` in HF layout (q/k rows un-permuted for llama); with `part` (a
        tensor-parallel rank's slice, `parallel/sharding.py`) only those ranges, cut from the whole dequantized
        tensor: each rank reads and dequantizes every tensor whole, one at a time, and keeps its slice."""
        tensor = self._tensor(name)
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise CheckpointError(
                f"{self.path}: tensor {tensor.name} ({name}) is stored as {tensor.tensor_type.name}, "
                "which the gguf package cannot dequantize"
            ) from exc
        values = values.reshape(self.tensor_shape(name))
        if self.arch in _PERMUTED_QK_ARCHS and (".q_proj." in name or ".k_proj." in name):
            n_head = self.config["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            if values.shape[0] % (2 * n_head):
                raise CheckpointError(
                    f"{self.path}: {tensor.name} has {values.shape[0]} rows, not a multiple of 2 x {n_head} heads, "
                    "so llama.cpp's q/k permutation cannot be undone"
                )
            values = _unpermute_rows(values, n_head)
        if not values.flags.writeable:  # F32 tensors come back as read-only views of the memory map
            values = values.copy()
        return take_part(torch.from_numpy(values), part).to(dtype)

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, arch={self.arch!r}, tensors={len(self._tensors)})"


def _existing_file(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"GGUF checkpoint not found: {path}")
    if not path.is_file():
        raise CheckpointError(f"GGUF checkpoint path is not a regular file: {path}")
    return path


def open_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Open (memory-map) a GGUF file, validating header, tensor table, architecture and names."""
    path = _existing_file(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as exc:
        # The gguf reader reports bad magic / short data as bare numpy errors; name the file and the cause.
        raise CheckpointError(
            f"{path}: not a valid GGUF file, or it is corrupt or truncated (gguf reader: {exc})"
        ) from exc
    return GGUFCheckpoint(path, reader)


def _tokenizer_cache_dir(path: Path) -> Path:
    """Where the converted tokenizer of this exact file (name, size, mtime) is kept between runs."""
    root = Path(os.environ.get("DFLASH_TFM_CACHE", Path.home() / ".cache" / "dflash_tfm"))
    st = path.stat()
    return root / "gguf_tokenizers" / f"{path.name}-{st.st_size}-{st.st_mtime_ns}"


def load_gguf_tokenizer(checkpoint: GGUFCheckpoint | str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Build a fast tokenizer from the GGUF's tokenizer metadata with transformers (offline).

    Token ids match transformers' GGUF tokenizer exactly. Special tokens are then reset from the
    metadata ids, because transformers' GGUF llama converter sets eos to the *bos* token (and qwen's to
    "</s>"); the chat template is taken from `tokenizer.chat_template`. The conversion re-parses the whole
    file (seconds), so its result is saved under ~/.cache/dflash_tfm (or $DFLASH_TFM_CACHE) and reused.
    """
    if not isinstance(checkpoint, GGUFCheckpoint):
        checkpoint = open_gguf(checkpoint)
    cache = _tokenizer_cache_dir(checkpoint.path)
    if (cache / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
        except (ValueError, KeyError, OSError):
            pass  # a damaged cache entry is rebuilt below
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(checkpoint.path.parent),
            gguf_file=checkpoint.path.name,
            local_files_only=True,
            clean_up_tokenization_spaces=False,
        )
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{checkpoint.path}: cannot build a tokenizer from its metadata ({exc})") from exc
    for kind in ("bos", "eos", "pad", "unk"):
        key = {"pad": "padding", "unk": "unknown"}.get(kind, kind)
        token_id = checkpoint.metadata(f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None:
            setattr(tokenizer, f"{kind}_token", tokenizer.convert_ids_to_tokens(int(token_id)))
    template = checkpoint.metadata("tokenizer.chat_template", None)
    if template is not None:
        tokenizer.chat_template = template
    try:
        tokenizer.save_pretrained(str(cache))
    except OSError:
        pass  # read-only home: convert again next time
    return tokenizer
