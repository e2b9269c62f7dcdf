"""Which quantized checkpoints load, and the `--quantization` flag.

A checkpoint declares its quantization in `config.json` `quantization_config` (at the top level, or inside
`text_config` for some vision-language wrappers). The one format read is the FP8 block format of Qwen's and
DeepSeek's releases (transformers' `FineGrainedFP8Config`): `quant_method: "fp8"`, `fmt: "e4m3"`,
`weight_block_size: [128, 128]`, dynamic activations, fp32 scales. Everything else is refused here, naming the
method, before any tensor is read: other methods need kernels this engine does not have, and loading their packed
tensors as plain weights would be wrong.
"""
from __future__ import annotations

from dflash_tfm.errors import CheckpointError

FP8 = "fp8"
QUANTIZATION_CHOICES = (FP8,)  # values of --quantization
KNOWN_METHODS = ("awq", "gptq", "compressed-tensors", "modelopt", "bitsandbytes", "mxfp4", "fbgemm_fp8", "hqq",
                 "torchao", "eetq", "aqlm", "quanto", "auto-round", "fp_quant", "bitnet", "higgs", "vptq", "spqr")


def checkpoint_quantization(raw: dict) -> str | None:
    """The quantization a model config declares: None (plain weights) or "fp8"; CheckpointError for anything else
    or an FP8 variant the kernels do not implement."""
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method != FP8:
        known = "" if method in KNOWN_METHODS else " (an unknown method)"
        raise CheckpointError(f"quantization method {method or '(none)'!r}{known} is not supported; the engine "
                              "loads plain BF16/FP16/FP32 weights, GGUF files and FP8 block-quantized checkpoints "
                              "(quant_method 'fp8', weight_block_size [128, 128])")
    problems = []
    if qc.get("fmt", "e4m3") != "e4m3":
        problems.append(f"fmt {qc['fmt']!r} (only e4m3)")
    if list(qc.get("weight_block_size") or []) != [128, 128]:
        problems.append(f"weight_block_size {qc.get('weight_block_size')!r} (only [128, 128]; per-tensor FP8 "
                        "checkpoints have none)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme {qc['activation_scheme']!r} (only dynamic)")
    if qc.get("scale_fmt") not in (None, "float32"):
        problems.append(f"scale_fmt {qc['scale_fmt']!r} (only fp32 scales)")
    if problems:
        raise CheckpointError("unsupported FP8 checkpoint: " + "; ".join(problems))
    return FP8


def check_quantization_flag(value: str | None) -> str | None:
    """`--quantization`: None (load as stored) or "fp8" (quantize BF16 projections at load)."""
    if value is None or value in QUANTIZATION_CHOICES:
        return value
    raise ValueError(f"--quantization {value!r} is not supported; choose {', '.join(QUANTIZATION_CHOICES)} "
                     "(or leave it out to load the weights as stored)")
