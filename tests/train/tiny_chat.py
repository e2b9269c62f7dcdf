"""A tiny chat checkpoint for engine-level tests: a random `tests.models.tiny_targets` target (llama by default,
vocab 160) plus a word-level tokenizer with a ChatML-like template, saved as a real HF directory the engine loads like any other."""
from __future__ import annotations

from pathlib import Path

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<pad>", "<extra>"]  # <|im_end|> = 2 = the llama config's eos
WORDS = ["user", "assistant", "hello", "world", "how", "many", "eggs", "two", "plus", "three", "is", "what"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def save_tiny_chat_model(root: Path, arch: str = "llama") -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.models.tiny_targets import VOCAB, save_hf_model

    _, path = save_hf_model(arch, root)
    words = SPECIALS + WORDS
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(VOCAB - len(words))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<pad>", additional_special_tokens=["<extra>"], chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(path)
    return path
