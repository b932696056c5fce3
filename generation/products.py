"""Float32 products of few rows on the CPU, each by the faster of two BLAS calls, measured: :func:`few_row_products`.

A verify multiplies B rows by every weight of the target. torch's ``F.linear(x, W)`` (x·Wᵀ) can be several times slower
for a few rows than the swapped call (W·xᵀ)ᵀ (AMD EPYC, MKL: 527 against 143 µs for 2 rows of a 1536 × 576 weight;
docs/benchmarks.md), by processor, shape and rows, and only with weights that come from memory, as in a forward. So per
(weight shape, rows, threads) the first :data:`TRIALS` products of each call are timed in the forwards (A B B A: two
same-shaped layers run in turn each get both), and the swapped call is kept for the process if its median is below
:data:`KEEP_BELOW` × torch's. Both compute the same product, the sums in another order, as any two kernels do: float32
greedy output stayed plain decoding's in every run measured, but floats (at an exact near-tie, a token) can differ in
the last bits between the trial rounds and later ones, or across processes. Float32 without autocast only: bfloat16
goes to oneDNN, where torch's call was the faster. Only exact ``nn.Linear`` modules with float32 CPU weights are
routed, inside the ``with`` block (for another thread using the same model meanwhile too)."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
import types

import torch
from torch import nn
from torch.nn import functional as F

TRIALS = 8
"""Products timed per call and key before the call is chosen."""
KEEP_BELOW = 0.9
"""The swapped call is kept only if its median time is below this fraction of torch's call's."""
MAX_ROWS = 64
"""Products of more rows always take ``F.linear``."""

_timings: dict[tuple, tuple[list[float], list[float]]] = {}  # key -> (F.linear seconds, swapped seconds)
_swapped: dict[tuple, bool] = {}  # decided keys -> whether the swapped call is kept
_routing = threading.Lock()  # routing and restoring modules: one block at a time


def swapped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as (W · xᵀ)ᵀ + bias: ``x [..., in]``, ``weight [out, in]`` -> ``[..., out]``."""
    y = (weight @ x.reshape(-1, x.shape[-1]).T).T.reshape(*x.shape[:-1], weight.shape[0]).contiguous()
    return y if bias is None else y + bias


def _forward(module: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` (its argument's name too) by the call kept for the key, timing both until one is kept."""
    weight, bias = module.weight, module.bias
    rows = input.numel() // max(1, input.shape[-1])
    if not 2 <= rows <= MAX_ROWS or input.dtype != torch.float32 or input.device.type != "cpu" \
            or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return F.linear(input, weight, bias)
    key = (tuple(weight.shape), rows, torch.get_num_threads())
    if (swapped := _swapped.get(key)) is not None:
        return swapped_linear(input, weight, bias) if swapped else F.linear(input, weight, bias)
    timings = _timings.setdefault(key, ([], []))
    swapped = (len(timings[0]) + len(timings[1])) % 4 in (1, 2)  # A B B A
    t0 = time.perf_counter()
    y = swapped_linear(input, weight, bias) if swapped else F.linear(input, weight, bias)
    timings[swapped].append(time.perf_counter() - t0)
    if min(map(len, timings)) >= TRIALS:
        _swapped[key] = statistics.median(timings[1]) < KEEP_BELOW * statistics.median(timings[0])
    return y


@contextlib.contextmanager
def few_row_products(*models: nn.Module | None):
    """Inside the block, float32 products of 2..:data:`MAX_ROWS` rows by ``models``' (None: skipped) ``nn.Linear`` CPU
    weights take the call kept for them (module doc), by a ``forward`` bound to each module instance and removed after
    (also when the block raises) unless replaced meanwhile; a module with an instance ``forward`` (accelerate's hooks,
    an enclosing block) is left as it is, so blocks nest."""
    routed = []  # (module, the forward set on it)
    try:
        with _routing:
            for model in models:
                for module in () if model is None else model.modules():
                    state, weight, bias = vars(module), module._parameters.get("weight"), module._parameters.get("bias")
                    if type(module) is nn.Linear and "forward" not in state and weight.dtype == torch.float32 \
                            and weight.device.type == "cpu" and (bias is None or bias.dtype == torch.float32):
                        # set and removed in __dict__, as nn.Module.__setattr__ would, without its checks
                        state["forward"] = types.MethodType(_forward, module)
                        routed.append((module, state["forward"]))
        yield
    finally:
        with _routing:
            for module, forward in routed:
                if vars(module).get("forward") is forward:
                    del vars(module)["forward"]
