"""What the benchmark scripts share apart from statistics (:mod:`benchmarks.stats`): the header every result JSON
starts with, writing a result, the machine and code it ran on, and the held-out prompts by domain.

Every script imports these as ``from benchmarks import common`` (or ``from benchmarks.common import ...``) after
putting the repository root on ``sys.path``; no script imports another script. This module imports only the
standard library at its top, so a script can import it before it decides which checkout's ``dspark`` to load.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

DOMAINS = {"math": ("gsm8k",), "code": ("humaneval",), "chat": ("mtbench", "alpaca")}
"""The held-out eval sets (``dspark.training.prompts``) behind each domain; a domain with several alternates them."""

SAME = ("sets", "limit", "block_size", "policy", "max_new_tokens", "dtype", "seed", "target")
"""Config keys of two ``dspark eval`` reports that must match for their τ to compare (paired or fitted)."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def device_name(device: str) -> str:
    """``device`` and, on CUDA, the GPU's name (the processor is named separately)."""
    import torch

    return f"{device} ({torch.cuda.get_device_name(device)})" if device.startswith("cuda") else device


KERNEL_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
"""Environment variables that hold torch's kernels below what the processor offers (e.g. AVX2 only on an AVX-512
CPU), recorded with every result."""


def machine_info(threads: int) -> dict:
    """The processor (:func:`dspark.evaluation.profiling.cpu_model`), core counts, torch threads, library versions,
    the load average at the start and the kernels' instruction limits set in the environment (:data:`KERNEL_LIMITS`)."""
    import torch
    import transformers

    from dspark.evaluation.profiling import cpu_model

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": load,
        "kernel_limits": {k: os.environ[k] for k in KERNEL_LIMITS if os.environ.get(k)},
    }


def code_version(root: str | os.PathLike = REPO_ROOT) -> str | None:
    """The commit of the checkout at ``root`` (``git describe --always --dirty --abbrev=40``: ``-dirty`` where its
    tracked files differ from it); None outside a checkout or without git."""
    try:
        proc = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=40"],
                              capture_output=True, text=True)
    except OSError:
        return None
    return proc.stdout.strip() or None


def result_header(benchmark: str, argv: list[str] | None, threads: int) -> dict:
    """The keys every benchmark JSON starts with: its name, the UTC date, the code it ran (:func:`code_version`), the
    command line (``argv``, else ``sys.argv``) and :func:`machine_info`."""
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "code": code_version(),
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "machine": machine_info(threads),
    }


def write_json(data, out: str | os.PathLike, indent: int = 2) -> Path:
    """Write ``data`` as JSON to ``out`` (parents created), replacing the file in one step: a process killed
    mid-write (a time limit) leaves the last whole file, never a truncated one; returns the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=indent) + "\n")
    os.replace(partial, path)
    return path


def write_result(result: dict, table: str, out: str | os.PathLike, *, final: bool = True) -> Path:
    """Record the load average at the end, store ``table`` as ``result["markdown"]``, write ``result`` as JSON to
    ``out`` (:func:`write_json`) and, when ``final``, print the table; returns the path. Benchmarks also write after
    each finished part (``final=False``), so a run stopped by a time limit keeps what it measured."""
    try:
        result["machine"]["load_average_at_end"] = os.getloadavg()
    except OSError:
        pass
    result["markdown"] = table
    path = write_json(result, out)
    if final:
        print(table)
        print(f"\nwritten to {path}", file=sys.stderr)
    return path


def load_domain_prompts(per_domain: int, offset: int) -> dict[str, list[dict]]:
    """``{domain: [{"id", "prompt", "source"}]}``, ``per_domain`` each (:data:`DOMAINS`), after skipping the first
    ``offset`` prompts of every set; a domain with several sets alternates them."""
    from dspark.training.prompts import load_eval_prompts

    out = {}
    for domain, sets in DOMAINS.items():
        pools = [load_eval_prompts(s, offset + per_domain)[offset:] for s in sets]
        out[domain] = [pools[i % len(pools)][i // len(pools)] for i in range(per_domain)]
    return out


def tau_pairs(tau: list[float], base: list[float]) -> dict:
    """τ of one drafter against another's, unit by unit (:func:`benchmarks.stats.paired`), in the keys
    ``tau_gap.py`` and ``paired_eval.py`` write: ``mean_delta``, ``won``, ``lost``, ``batches`` (the pairs counted:
    evaluation batches, or prompts) and ``p`` (two-sided sign test)."""
    from benchmarks.stats import paired

    r = paired(tau, base)
    return {"mean_delta": r["mean_delta"], "won": r["won"], "lost": r["lost"], "batches": r["pairs"], "p": r["p"]}
