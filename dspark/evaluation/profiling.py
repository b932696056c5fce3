"""SPS(B) profiling: how many verify forwards per second the target runs when the verify batch holds B tokens.

The scheduler learns its prices from the rounds themselves (:mod:`dspark.generation.costs`); an explicit table measured
here (``dspark profile``, ``dspark bench serve --profile``) replaces the learned verify prices when given as
``dspark_options(sps=...)`` or to the engine. :func:`profile_target` times the target's verify forward exactly as
:class:`dspark.generation.packed_target.PackedTarget` runs it (R requests × q new tokens each, packed into one forward
of B = R·q tokens, on top of per-request KV caches holding ``context`` tokens), with warm-up, interleaved repeats and
medians, for given context lengths, requests counts, dtype and thread count.

Tables are stored in one JSON file (default ``$DSPARK_PROFILE_DIR/sps.json``, else
``$DSPARK_CACHE/profiles/sps.json``, else ``~/.cache/dspark/profiles/sps.json``)::

    {"format": "dspark-sps-profile/1",
     "profiles": {MODEL: {DTYPE: {THREADS: {CONTEXT: {R: {B: steps_per_s}}}}}},
     "meta":     {"MODEL|DTYPE|THREADS|CONTEXT|R": {"raw_sps": {B: ...}, "cpu_model": ..., "warmup": ..., ...}},
     "dtype":    {"TARGET|DRAFTER|THREADS|DEVICE": {"tokens_per_s": {DTYPE: ...}, "cpu_model": ..., ...}}}

(all keys are strings in JSON; ``"dtype"`` is the cache of ``--dtype auto``, :mod:`dspark.evaluation.dtype`). The stored
curve is the medians made non-increasing in B (isotonic regression of the step time): a bigger verify batch is
never faster, and Algorithm 1's early stop relies on a unimodal Θ(B); the raw medians are kept under ``meta``, with
the processor that measured them (``cpu_model``, see :func:`device_model`): a table from another processor is never
used. A measurement that fails :func:`timing_problem` (repeats spread too wide, or a bigger B much faster than a
smaller one: another program was competing for the cores) is reported with the result.

Loading: :func:`load_sps` gives a callable B -> steps/s for one (model, dtype, threads, context, R); between
measured B it interpolates the step time linearly; a B outside the measured range raises a ValueError naming the
range. Context lengths snap to the nearest measured bucket; R between measured values is interpolated (at the same
tokens per request q = B / R).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "PROFILE_FORMAT",
    "QUICK_TOKENS",
    "BATCHED_TOKENS",
    "DEFAULT_CONTEXTS",
    "SPSCurve",
    "SPSProfile",
    "profile_dir",
    "default_profile_path",
    "target_name",
    "dtype_name",
    "synchronize",
    "measure_verify",
    "profile_target",
    "save_profile",
    "load_profile",
    "load_sps",
    "timing_problem",
]

PROFILE_FORMAT = "dspark-sps-profile/1"
QUICK_TOKENS = tuple(range(1, 18))
"""q values of the default R = 1 profile: B = 1..17 (block size 16 + the anchor)."""
BATCHED_TOKENS = (1, 2, 3, 5, 9, 17)
"""q values measured for R > 1 (B = R·q); the loader interpolates in between."""
DEFAULT_CONTEXTS = (256,)
"""Context lengths (tokens already in each request's KV cache) of the default quick profile."""
MAX_REPEAT_SPREAD = 0.5
"""A measurement is refused when the repeats of one B spread more than this fraction of their median."""
MAX_FASTER_AT_LARGER_B = 0.25
"""A measurement is refused when a larger B's median step time is more than this fraction below a smaller B's."""
def timing_problem(times: Mapping[int, Sequence[float]]) -> str | None:
    """Why a measurement ``{B: [seconds per forward, …]}`` is implausible, or None when it is plausible.

    Two checks, on the raw repeats (before the curve is made non-increasing):

    * spread: for some B, (max − min) / median of its repeats > :data:`MAX_REPEAT_SPREAD`;
    * order: for some B < B', median t(B') < (1 − :data:`MAX_FASTER_AT_LARGER_B`) · median t(B) — a bigger
      verify batch is never much faster; it happens when other programs steal the cores mid-measurement.
    """
    med = {int(b): statistics.median(ts) for b, ts in sorted(times.items()) if ts}
    for b, ts in sorted(times.items()):
        if len(ts) > 1 and (max(ts) - min(ts)) / med[int(b)] > MAX_REPEAT_SPREAD:
            return (f"the repeats at B={b} spread {(max(ts) - min(ts)) / med[int(b)]:.0%} of their median "
                    f"(> {MAX_REPEAT_SPREAD:.0%})")
    slowest_so_far = None  # (B, t) with the largest median step time among smaller B
    for b, t in med.items():
        if slowest_so_far is not None and t < (1 - MAX_FASTER_AT_LARGER_B) * slowest_so_far[1]:
            return (f"B={b} ran {1 - t / slowest_so_far[1]:.0%} faster than B={slowest_so_far[0]} "
                    f"(> {MAX_FASTER_AT_LARGER_B:.0%}: a bigger verify is never much faster)")
        if slowest_so_far is None or t > slowest_so_far[1]:
            slowest_so_far = (b, t)
    return None


# ---------------------------------------------------------------------------------------------- names, paths
def profile_dir() -> Path:
    """``$DSPARK_PROFILE_DIR``, else ``$DSPARK_CACHE/profiles``, else ``~/.cache/dspark/profiles``."""
    if os.environ.get("DSPARK_PROFILE_DIR"):
        return Path(os.environ["DSPARK_PROFILE_DIR"])
    base = os.environ.get("DSPARK_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "dspark") / "profiles"


def default_profile_path() -> Path:
    """The JSON file holding every profile of this machine (see the module doc)."""
    return profile_dir() / "sps.json"


_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""Instruction-set flags that change the target's speed most (bf16 and wide matrix units); part of the name."""


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """This machine's processor: ``/proc/cpuinfo``'s "model name" (else ``platform.processor()`` or the
    architecture) with the flags of :data:`_CPU_FLAGS` it has and its logical core count, e.g.
    ``"AMD EPYC [avx2] x2"``. Virtual machines often report a generic model name, hence the flags. Profiles record
    it: an SPS table measured on another processor is not used (:func:`load_profile`)."""
    from modeling_dspark.target import cpu_flags

    name = None
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    flags = cpu_flags()
    have = " ".join(f for f in _CPU_FLAGS if f in flags)
    return f"{name} [{have}] x{os.cpu_count() or 1}" if have else f"{name} x{os.cpu_count() or 1}"


def device_model(device) -> str:
    """What an SPS table depends on besides the model: :func:`cpu_model` on CPU, the GPU's name on CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return cpu_model()


def _stale_entries(data: Mapping, model: str, dtype: str, threads: str, processor: str) -> list[str]:
    """Tables of (model, dtype, threads) not known to be measured on ``processor`` (meta keys
    ``MODEL|DTYPE|THREADS|CONTEXT|R``): measured on another one, or with no processor recorded (files written before
    processors were, hand-written tables)."""
    node = data.get("profiles", {}).get(model, {}).get(dtype, {}).get(threads, {})
    meta = data.get("meta", {})
    keys = [f"{model}|{dtype}|{threads}|{c}|{r}" for c, per_r in node.items() for r in per_r]
    return [k for k in keys if meta.get(k, {}).get("cpu_model") != processor]


def target_name(target) -> str:
    """A stable name for a target: the checkpoint directory's name, else ``family-h…-l…-v…``."""
    cfg = target.config
    name = str(getattr(cfg, "_name_or_path", "") or getattr(cfg, "name_or_path", "") or "")
    if name:
        return Path(name.rstrip("/")).name or name
    tc = cfg.get_text_config()
    return f"{tc.model_type}-h{tc.hidden_size}-l{tc.num_hidden_layers}-v{tc.vocab_size}"


def dtype_name(dtype) -> str:
    """``torch.float32`` / ``"float32"`` -> ``"float32"``."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return name


# ---------------------------------------------------------------------------------------------- curves
def _isotonic_non_decreasing(values: Sequence[float]) -> list[float]:
    """Pool-adjacent-violators: the closest (least squares) non-decreasing sequence."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: list[float] = []
    for s, c in blocks:
        out += [s / c] * int(c)
    return out


def monotone_sps(raw: Mapping[int, float]) -> dict[int, float]:
    """Make a measured {B: steps/s} table non-increasing in B (isotonic regression of the step time 1/SPS)."""
    bs = sorted(int(b) for b in raw)
    times = _isotonic_non_decreasing([1.0 / float(raw[b]) for b in bs])
    return {b: 1.0 / t for b, t in zip(bs, times)}


class SPSCurve:
    """SPS(B) for one (model, dtype, threads, context, R): a callable ``B -> steps/s``.

    Between measured B the step time 1/SPS is interpolated linearly; a B outside ``[min_batch, max_batch]``
    raises a ValueError that names the range. Also usable as the ``sps`` of
    :meth:`dspark.generation.policies.Policy.start` (the scheduler's verify prices).
    """

    def __init__(self, points: Mapping[int, float], description: str = ""):
        if not points:
            raise ValueError("an SPS curve needs at least one measured point")
        pts = sorted((int(b), float(s)) for b, s in points.items())
        for b, s in pts:
            if b < 1 or not math.isfinite(s) or s <= 0:
                raise ValueError(f"bad SPS point B={b}: {s!r} steps/s")
        self.points = dict(pts)
        self._bs = [b for b, _ in pts]
        self._t = [1.0 / s for _, s in pts]
        self.description = description

    @property
    def min_batch(self) -> int:
        return self._bs[0]

    @property
    def max_batch(self) -> int:
        return self._bs[-1]

    def __call__(self, batch_tokens: int) -> float:
        b = float(batch_tokens)
        if not self._bs[0] <= b <= self._bs[-1]:
            where = f" ({self.description})" if self.description else ""
            raise ValueError(
                f"verify batch size B = {batch_tokens} is outside the profiled range "
                f"{self._bs[0]}..{self._bs[-1]}{where}; profile larger batches (`dspark profile --tokens ...`)"
            )
        import bisect

        j = bisect.bisect_left(self._bs, b)
        if self._bs[j] == b:
            return 1.0 / self._t[j]
        b0, b1, t0, t1 = self._bs[j - 1], self._bs[j], self._t[j - 1], self._t[j]
        return 1.0 / (t0 + (t1 - t0) * (b - b0) / (b1 - b0))

    def __getitem__(self, batch_tokens: int) -> float:  # Mapping-style access
        return self(batch_tokens)

    def __repr__(self) -> str:
        return f"SPSCurve({self.description or 'B=' + str(self.min_batch) + '..' + str(self.max_batch)})"


class SPSProfile:
    """Every measured curve of one (model, dtype, threads): ``tables[context][R] = {B: steps/s}``."""

    def __init__(self, model: str, dtype: str, threads: int, tables: Mapping[int, Mapping[int, Mapping[int, float]]]):
        if not tables:
            raise ValueError(f"empty SPS profile for {model} / {dtype} / {threads} threads")
        self.model, self.dtype, self.threads = model, dtype, int(threads)
        self.tables = {int(c): {int(r): {int(b): float(s) for b, s in t.items()} for r, t in rs.items()}
                       for c, rs in tables.items()}

    @property
    def contexts(self) -> list[int]:
        return sorted(self.tables)

    def requests(self, context: int) -> list[int]:
        return sorted(self.tables[context])

    def context_bucket(self, context_len: float | None) -> int:
        """The measured context length nearest to ``context_len`` (log distance); the smallest for None."""
        cs = self.contexts
        if context_len is None:
            return cs[0]
        x = math.log(max(1.0, float(context_len)))
        return min(cs, key=lambda c: (abs(math.log(max(1, c)) - x), c))

    def covers(self, requests: int, max_batch: int, context_len: float | None = None) -> bool:
        """Whether :meth:`curve` for ``requests`` exists and reaches ``max_batch``."""
        try:
            return self.curve(requests, context_len).max_batch >= max_batch
        except ValueError:
            return False

    def curve(self, requests: int = 1, context_len: float | None = None) -> SPSCurve:
        """SPS(B) for R = ``requests`` at the context bucket nearest ``context_len``.

        Raises:
            ValueError: R outside the measured R range of that bucket.
        """
        ctx = self.context_bucket(context_len)
        per_r = self.tables[ctx]
        desc = f"{self.model} {self.dtype} {self.threads} threads, context {ctx}, R={requests}"
        if requests in per_r:
            return SPSCurve(per_r[requests], desc)
        rs = sorted(per_r)
        lo = [r for r in rs if r < requests]
        hi = [r for r in rs if r > requests]
        if not lo or not hi:
            raise ValueError(
                f"no SPS profile for R = {requests} requests ({self.model}, {self.dtype}, {self.threads} threads, "
                f"context {ctx}); measured R = {rs}; run `dspark profile --requests {requests}`"
            )
        r0, r1 = lo[-1], hi[0]
        q0 = {b / r0: 1.0 / s for b, s in per_r[r0].items()}
        q1 = {b / r1: 1.0 / s for b, s in per_r[r1].items()}
        w = (requests - r0) / (r1 - r0)
        points = {}
        for q in sorted(set(q0) & set(q1)):
            b = q * requests
            if abs(b - round(b)) < 1e-9:
                points[int(round(b))] = 1.0 / ((1 - w) * q0[q] + w * q1[q])
        if not points:
            raise ValueError(f"R = {r0} and R = {r1} profiles share no tokens-per-request value to interpolate")
        return SPSCurve(points, desc + f" (interpolated from R={r0},{r1})")

    def to_dict(self) -> dict:
        return {str(c): {str(r): {str(b): s for b, s in sorted(t.items())} for r, t in sorted(rs.items())}
                for c, rs in sorted(self.tables.items())}


# ---------------------------------------------------------------------------------------------- measuring
def synchronize(device) -> None:
    """Wait for ``device``'s queued work (CUDA), so a wall-clock timing covers it; a no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_verify(
    target,
    requests: int,
    tokens: Sequence[int],
    context_len: int,
    warmup: int = 1,
    repeats: int = 5,
    seed: int = 0,
) -> dict[int, list[float]]:
    """Time verify forwards of R = ``requests`` × q tokens on caches of ``context_len`` tokens, each q in ``tokens``.

    Measurements are interleaved (one pass over all q per repeat) so slow drifts of the machine spread over every
    B; ``warmup`` passes are discarded. Returns ``{q: [seconds per forward, …]}``.
    """
    from dspark.generation.packed_target import PackedTarget

    packed = PackedTarget(target)
    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.get_text_config().vocab_size
    device = target.device
    max_q = max(tokens)
    caches = [packed.new_cache(context_len + max_q + 1) for _ in range(requests)]
    if context_len > 0:
        for kv in caches:  # prefill one request at a time (not timed)
            packed.forward([(kv, torch.randint(0, vocab, (context_len,), generator=gen))])
    new_ids = {q: [torch.randint(0, vocab, (q,), generator=gen) for _ in range(requests)] for q in tokens}
    times: dict[int, list[float]] = {q: [] for q in tokens}
    for rep in range(warmup + repeats):
        for q in tokens:
            segs = [(kv, ids) for kv, ids in zip(caches, new_ids[q])]
            synchronize(device)
            t0 = time.perf_counter()
            packed.forward(segs)
            synchronize(device)
            dt = time.perf_counter() - t0
            for kv in caches:
                kv.crop(context_len)
            if rep >= warmup:
                times[q].append(dt)
    return times


def profile_target(
    target,
    *,
    contexts: Iterable[int] = DEFAULT_CONTEXTS,
    requests: Iterable[int] = (1,),
    tokens: Sequence[int] | None = None,
    threads: int | None = None,
    warmup: int = 1,
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
    origin: str = "explicit",
) -> dict:
    """Measure SPS(B) tables of ``target`` on this machine.

    Args:
        target: the target causal LM (its dtype and device are profiled as they are).
        contexts: context lengths (tokens in each request's KV cache).
        requests: R values; B = R·q.
        tokens: q values (new tokens per request); default 1..17 for R = 1 and (1, 2, 3, 5, 9, 17) for R > 1.
        threads: torch CPU threads during the measurement (default: the current setting); restored afterwards.
        warmup, repeats: discarded passes and timed passes (the median is kept).
        progress: optional callback receiving one line per (context, R).
        origin: recorded in ``meta``.

    Returns:
        ``{"model", "dtype", "threads", "tables": {context: {R: {B: sps}}}, "raw": {context: {R: {B: sps}}},
        "problems": {context: {R: reason}}, "meta": {...}}`` — pass it to :func:`save_profile`. ``problems`` lists
        the measurements :func:`timing_problem` finds implausible (empty when none).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    contexts = sorted({int(c) for c in contexts})
    requests = sorted({int(r) for r in requests})
    if not contexts or not requests or min(requests) < 1 or min(contexts) < 0:
        raise ValueError(f"need contexts >= 0 and requests >= 1; got contexts={contexts}, requests={requests}")
    old_threads = torch.get_num_threads()
    threads = int(threads or old_threads)
    torch.set_num_threads(threads)
    t_start = time.perf_counter()
    try:
        tables, raw, problems = _measure_grid(target, contexts, requests, tokens, warmup, repeats, progress)
    finally:
        torch.set_num_threads(old_threads)
    return {
        "model": target_name(target),
        "dtype": dtype_name(target.dtype),
        "threads": threads,
        "tables": tables,
        "raw": raw,
        "problems": problems,
        "meta": _profile_meta(target, origin, warmup, repeats, time.perf_counter() - t_start),
    }


def _measure_grid(target, contexts: list[int], requests: list[int], tokens: Sequence[int] | None, warmup: int,
                  repeats: int, progress: Callable[[str], None] | None):
    """The measurements of :func:`profile_target`, context by context and R by R: ``(tables, raw, problems)``.

    Raises:
        ValueError: a q value < 1.
    """
    tables: dict[int, dict[int, dict[int, float]]] = {}
    raw: dict[int, dict[int, dict[int, float]]] = {}
    problems: dict[int, dict[int, str]] = {}
    for ctx in contexts:
        for r in requests:
            qs = sorted({int(q) for q in (tokens or (QUICK_TOKENS if r == 1 else BATCHED_TOKENS))})
            if min(qs) < 1:
                raise ValueError(f"tokens per request must be >= 1, got {qs}")
            times = measure_verify(target, r, qs, ctx, warmup=warmup, repeats=repeats)
            medians = {r * q: 1.0 / statistics.median(ts) for q, ts in times.items()}
            problem = timing_problem({r * q: ts for q, ts in times.items()})
            if problem:
                problems.setdefault(ctx, {})[r] = problem
            raw.setdefault(ctx, {})[r] = medians
            tables.setdefault(ctx, {})[r] = monotone_sps(medians)
            if progress is not None:
                lo, hi = min(medians), max(medians)
                progress(f"context {ctx}, R={r}: B={lo}..{hi}, SPS {medians[lo]:.1f} -> {medians[hi]:.1f} steps/s")
    return tables, raw, problems


def _profile_meta(target, origin: str, warmup: int, repeats: int, seconds: float) -> dict:
    """The ``meta`` of a :func:`profile_target` result: how, where and when the tables were measured."""
    return {
        "origin": origin,
        "warmup": warmup,
        "repeats": repeats,
        "device": str(target.device),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": device_model(target.device),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "seconds": round(seconds, 2),
    }


# ---------------------------------------------------------------------------------------------- storage
def _read(path: Path) -> dict:
    if not path.exists():
        return {"format": PROFILE_FORMAT, "profiles": {}, "meta": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"unreadable SPS profile file {str(path)!r}: {err}") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{str(path)!r} is not a {PROFILE_FORMAT} file")
    data.setdefault("profiles", {})
    data.setdefault("meta", {})
    return data


def _write(path: Path, data: Mapping) -> None:
    """Write the profile file atomically (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def save_profile(result: Mapping, path: str | os.PathLike | None = None) -> Path:
    """Merge a :func:`profile_target` result into the JSON file (default :func:`default_profile_path`).

    Existing entries for other models / dtypes / threads / contexts / R are kept; measured ones are replaced.
    Written atomically. Returns the path.
    """
    path = Path(path) if path is not None else default_profile_path()
    data = _read(path)
    model, dtype, threads = result["model"], result["dtype"], str(result["threads"])
    cpu = result.get("meta", {}).get("cpu_model")
    if cpu is not None and _stale_entries(data, model, dtype, threads, cpu):  # measured elsewhere (or unknown):
        data["profiles"].get(model, {}).get(dtype, {}).pop(threads, None)  # replace, never mix, the tables
        for k in [k for k in data["meta"] if k.startswith(f"{model}|{dtype}|{threads}|")]:
            del data["meta"][k]
    node = data["profiles"].setdefault(model, {}).setdefault(dtype, {}).setdefault(threads, {})
    for ctx, per_r in result["tables"].items():
        for r, table in per_r.items():
            node.setdefault(str(ctx), {})[str(r)] = {str(b): round(float(s), 6) for b, s in sorted(table.items())}
            raw = result.get("raw", {}).get(ctx, {}).get(r, {})
            data["meta"][f"{model}|{dtype}|{threads}|{ctx}|{r}"] = {
                **result.get("meta", {}),
                "raw_sps": {str(b): round(float(s), 6) for b, s in sorted(raw.items())},
            }
    _write(path, data)
    return path


def load_profile(
    target_name: str, dtype, threads: int, path: str | os.PathLike | None = None, device="cpu",
) -> SPSProfile:
    """The stored :class:`SPSProfile` of (model, dtype, threads), measured on this processor (:func:`device_model`
    of ``device``: the CPU, or the GPU for a CUDA device).

    Raises:
        FileNotFoundError: no profile file, none for this (model, dtype, threads), or one measured on another
            processor (a copied cache, a home directory shared across machines) — the message says how to make one.
        ValueError: a corrupt file.
    """
    path = Path(path) if path is not None else default_profile_path()
    dtype = dtype_name(dtype)
    hint = f"run `dspark profile --dtype {dtype} --threads {threads}`"
    if not path.exists():
        raise FileNotFoundError(f"no SPS profile file at {str(path)!r}; {hint}")
    data = _read(path)
    try:
        node = data["profiles"][target_name][dtype][str(int(threads))]
    except KeyError:
        raise FileNotFoundError(
            f"no SPS profile for {target_name!r} / {dtype} / {threads} threads in {str(path)!r}; {hint}"
        ) from None
    here = device_model(device)
    stale = _stale_entries(data, target_name, dtype, str(int(threads)), here)
    if stale:
        raise FileNotFoundError(
            f"the SPS profile for {target_name!r} / {dtype} / {threads} threads in {str(path)!r} was measured on "
            f"another processor ({data['meta'].get(stale[0], {}).get('cpu_model') or 'not recorded'}; this one is "
            f"{here!r}); {hint}"
        )
    tables = {int(c): {int(r): t for r, t in rs.items()} for c, rs in node.items()}
    return SPSProfile(target_name, dtype, threads, tables)


def load_sps(
    target_name: str,
    dtype,
    threads: int,
    context_len: float | None = None,
    requests: int = 1,
    path: str | os.PathLike | None = None,
    device="cpu",
) -> SPSCurve:
    """SPS(B) callable (steps/s) for one target / dtype / thread count at the nearest context bucket and R, as
    measured on ``device``'s processor (:func:`device_model`; "cpu" or a CUDA device).

    Raises:
        FileNotFoundError: nothing profiled for (model, dtype, threads) on this processor.
        ValueError: R outside the measured range; later, B outside the profiled range when called.
    """
    return load_profile(target_name, dtype, threads, path, device=device).curve(requests, context_len)
