"""``--dtype auto``: the faster dtype for the job, measured on this processor (the CLI and the demo page use it).

float32 is the token-exact dtype: in bfloat16 a batched verify rounds differently from a one-token step, so at a
near-tie the output can part from plain decoding.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from dspark.evaluation.profiling import _read, _write, default_profile_path, device_model, dtype_name, synchronize
from modeling_dspark.target import fast_dtype

logger = logging.getLogger(__name__)

__all__ = ["DTYPE_PROMPT", "DTYPE_MARGIN", "OTHERS_BUSY", "auto_dtype"]

DTYPE_PROMPT = "Write a Python function that returns the n-th Fibonacci number, then explain how it works."
"""The prompt :func:`auto_dtype` times ``generate()`` on (chat template applied)."""
DTYPE_MARGIN = 0.05
"""bfloat16 is chosen only when it runs more than this fraction faster than float32 (the token-exact mode)."""
OTHERS_BUSY = 0.5
"""A timing is cached only where other work took fewer CPUs than this from its threads meanwhile (psutil)."""


def _dtype_key(target, drafter, threads: int, device) -> str:
    """``TARGET|DRAFTER|THREADS|DEVICE`` naming one measured job in the profile file's ``"dtype"`` section."""
    from modeling_dspark.hub import shipped_drafter_dir
    from modeling_dspark.target import DEFAULT_TARGET, PACKAGED_TARGETS

    t = str(target or DEFAULT_TARGET)
    t = t if t in PACKAGED_TARGETS else str(Path(t).expanduser().resolve())
    if drafter is not None and not Path(drafter).is_dir():  # a shipped drafter's name: its folder, as the CLI passes
        drafter = shipped_drafter_dir(drafter) or drafter
    d = "plain" if drafter is None else (str(Path(drafter).resolve()) if Path(drafter).is_dir() else str(drafter))
    return f"{t}|{d}|{threads}|{torch.device(device).type}"


def _loaded_from(model):
    """A name or directory as given; a loaded model: the directory it was loaded from (``name_or_path``).

    Raises:
        ValueError: a model that was not loaded from a directory (made with ``from_config``): nothing to time.
    """
    if model is None or isinstance(model, (str, os.PathLike)):
        return model
    if not getattr(model, "name_or_path", ""):
        raise ValueError(f"this {type(model).__name__} was not loaded from a directory (empty name_or_path); "
                         "auto_dtype loads what it times in each dtype: pass a name or directory")
    return model.name_or_path


@torch.inference_mode()
def _time_generate(target, drafter, dtypes, max_new_tokens: int, repeats: int, device) -> dict[str, float]:
    """Tokens/s of greedy ``generate()`` on :data:`DTYPE_PROMPT` in each of ``dtypes``: one warm-up call each, then
    ``repeats`` interleaved timed calls, the fastest kept (the least disturbed by other load)."""
    import copy

    from modeling_dspark import DSparkDraftModel
    from modeling_dspark.target import apply_chat_template, load_target

    base, tok = load_target(target, dtype=torch.float32, device=str(device))
    ids = torch.tensor([apply_chat_template(tok, DTYPE_PROMPT)], device=base.device)
    models = {}
    for dt in dtypes:
        t = base if dt == torch.float32 else copy.deepcopy(base).to(dt)
        d = None if drafter is None else DSparkDraftModel.from_pretrained(drafter, target=t, dtype=dt)
        models[dtype_name(dt)] = (t, d)
    kw = {"do_sample": False, "attention_mask": torch.ones_like(ids), "pad_token_id": tok.eos_token_id}
    best: dict[str, float] = {}
    for rep in range(1 + repeats):
        for name, (t, d) in models.items():
            synchronize(device)
            t0 = time.perf_counter()
            out = t.generate(ids, assistant_model=d, max_new_tokens=max_new_tokens if rep else 4, **kw)
            synchronize(device)
            if rep:
                rate = (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)
                best[name] = max(best.get(name, 0.0), rate)
    return best


def _cpu_seconds() -> tuple[float, float, float, int]:
    """Now: (wall seconds, busy seconds of this process's CPUs, this process's CPU seconds, those CPUs' count), by
    psutil; the whole machine's where the affinity's CPU ids are not psutil's. :func:`_contention` takes differences."""
    import psutil

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per = psutil.cpu_times(percpu=True)
    if cores and max(cores) < len(per):
        times, cpus = [per[c] for c in cores], len(cores)
    else:
        times, cpus = [psutil.cpu_times()], len(per)
    idle = ("idle", "iowait", "guest", "guest_nice")  # guest time is counted in user time already
    busy = sum(sum(t) - sum(getattr(t, f, 0.0) for f in idle) for t in times)
    own = psutil.Process().cpu_times()
    return time.perf_counter(), busy, own.user + own.system, cpus


def _contention(start: tuple[float, float, float, int], threads: int) -> float:
    """CPUs' worth of other work that shared the CPUs of ``threads`` torch threads since ``start``
    (:func:`_cpu_seconds`): the CPUs other work kept busy (their busy seconds less this process's, over the wall
    seconds; other processes, the hypervisor's steal) beyond those the threads left free."""
    wall, busy, own = (b - a for a, b in zip(start[:3], _cpu_seconds()[:3]))
    return max(0.0, max(0.0, busy - own) / max(wall, 1e-9) - max(0, start[3] - threads))


_contended: dict[str, dict] = {}  # key -> this process's timing that other work shared CPUs with (not cached)


def _measure_dtypes(target, drafter, threads: int, device, max_new_tokens: int, repeats: int, path: Path,
                    key: str) -> tuple[dict, str]:
    """Time both dtypes with ``threads`` torch threads (:func:`_time_generate`) and cache the result under ``key``
    in ``path``, unless other work took :data:`OTHERS_BUSY` CPUs or more from the threads meanwhile (then it is kept
    for this process only, and returned here again): ``(profile entry, note)``, the note empty when cached."""
    if key in _contended and _contended[key]["cpu_model"] == device_model(device):
        return _contended[key], "; timed earlier in this process beside other work, so not cached"
    logger.warning("timing generate() in float32 and bfloat16 to pick the faster (%s; an explicit dtype skips "
                   "this); kept in %s unless other work shares its CPUs meanwhile",
                   "plain decoding" if drafter is None else f"drafter {drafter}", path)
    old, start = torch.get_num_threads(), _cpu_seconds()
    torch.set_num_threads(threads)
    try:
        rates = _time_generate(target, drafter, (torch.float32, torch.bfloat16), max_new_tokens, repeats, device)
    finally:
        torch.set_num_threads(old)
    shared = _contention(start, threads)
    entry = {"tokens_per_s": {k: round(v, 3) for k, v in rates.items()}, "cpu_model": device_model(device),
             "max_new_tokens": max_new_tokens, "repeats": repeats, "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if shared >= OTHERS_BUSY:  # a thread that shares its core stalls every step: a timing for this process only
        _contended[key] = entry
        return entry, f"; other work shared {shared:.1f} of its CPUs meanwhile, so this is not cached"
    data = _read(path)  # re-read: keep what another process wrote meanwhile
    data.setdefault("dtype", {})[key] = entry
    _write(path, data)
    return entry, ""


def auto_dtype(
    target: str | os.PathLike | None = None,
    drafter: str | os.PathLike | None = None,
    *,
    device="cpu",
    threads: int | None = None,
    path: str | os.PathLike | None = None,
    max_new_tokens: int = 32,
    repeats: int = 2,
) -> tuple[torch.dtype, str]:
    """The faster dtype for ``generate()`` of ``target`` (with ``drafter``, or plain decoding) here, and why.

    bfloat16 on CUDA (float32 below compute capability 8.0). On a CPU it depends on the processor and the job, with or
    without native bf16 matrix instructions: a one-token step is bound by reading the weights, which bf16 halves, while
    a B-token verify is bound by the products, which a CPU without native bf16 emulates (a 9-token bf16 verify measured
    6.7 one-token steps on an AVX2-only CPU, 3.1 in fp32). So both dtypes run the job itself — greedy ``generate()`` of
    :data:`DTYPE_PROMPT`, ``max_new_tokens`` tokens, with the drafter's default options — interleaved, ``repeats`` times
    each, the fastest run kept; bfloat16 wins only when more than :data:`DTYPE_MARGIN` faster (float32 is the
    token-exact mode). The tokens/s are cached in the SPS profile file (:func:`default_profile_path`, section
    ``"dtype"``, keyed by target, drafter, threads and device type, with the processor): measured once, a few seconds
    for a small target; a cache entry from another processor is measured again, and a measurement during which other
    work took :data:`OTHERS_BUSY` CPUs or more from its threads is kept for this process only (one of 2 cores busy made
    plain SmolLM2 on 2 threads 2.2–2.8× slower).

    Args:
        target: a target directory, a packaged target's name, or None for the default target; ``drafter``: a
            drafter directory, shipped drafter's name or Hub id, or None for plain decoding (a loaded model, either
            one: its ``name_or_path``, loaded again in each dtype); ``device``: ``"cpu"`` or a CUDA device.
        threads: torch CPU threads (default: the current setting), part of the cache key; ``path``: the profile
            file (default :func:`default_profile_path`); ``max_new_tokens``, ``repeats``: the measurement's size.

    Returns:
        ``(dtype, reason)``: ``torch.float32`` or ``torch.bfloat16``, and one line saying why.

    Raises:
        ValueError: ``max_new_tokens`` or ``repeats`` < 1, a model not loaded from a directory; errors of loading
            the target or drafter as they are.
    """
    if max_new_tokens < 1 or repeats < 1:
        raise ValueError(f"max_new_tokens and repeats must be >= 1; got {max_new_tokens}, {repeats}")
    if torch.device(device).type == "cuda":
        dtype = fast_dtype(device)  # bf16 from compute capability 8.0
        return dtype, "a GPU" + ("" if dtype == torch.bfloat16 else " without native bf16 (compute capability < 8.0)")
    target, drafter = map(_loaded_from, (target, drafter))
    threads = int(threads or torch.get_num_threads())
    path = Path(path) if path is not None else default_profile_path()
    key, here = _dtype_key(target, drafter, threads, device), device_model(device)
    entry = _read(path).get("dtype", {}).get(key)
    cached = entry is not None and entry.get("cpu_model") == here
    note = ""
    if not cached:
        entry, note = _measure_dtypes(target, drafter, threads, device, max_new_tokens, repeats, path, key)
    fp32, bf16 = entry["tokens_per_s"]["float32"], entry["tokens_per_s"]["bfloat16"]
    dtype = torch.bfloat16 if bf16 > fp32 * (1 + DTYPE_MARGIN) else torch.float32
    job = "plain generate()" if drafter is None else "generate() with this drafter"
    when = f"measured before ({entry.get('date', 'undated')[:10]})" if cached else "measured"
    why = (f"{when} on this CPU for {job}: bfloat16 {bf16:.1f} tok/s, float32 {fp32:.1f}"
           + ("; float32 is the token-exact dtype" if dtype == torch.bfloat16 else
              f"; bfloat16 is not more than {DTYPE_MARGIN:.0%} faster") + note)
    return dtype, why
