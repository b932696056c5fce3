"""SPS(B) profiling: how many verify forwards per second the target runs when the verify batch holds B tokens.

DSpark's scheduler (Algorithm 1, docs/method.md §4) weighs the expected committed tokens of a verify batch against
its cost, read from a step-rate table SPS(B) measured once on the real hardware. :func:`profile_target` times the
target's verify forward exactly as :class:`generation.packed_target.PackedTarget` runs it (R requests × q new tokens
each, packed into one forward of B = R·q tokens, on top of per-request KV caches holding ``context`` tokens), with
warm-up, interleaved repeats and medians, for given context lengths, requests counts, dtype and thread count.

Tables are stored in one JSON file (default ``$DSPARK_PROFILE_DIR/sps.json``, else
``$DSPARK_CACHE/profiles/sps.json``, else ``~/.cache/dspark/profiles/sps.json``)::

    {"format": "dspark-sps-profile/1",
     "profiles": {MODEL: {DTYPE: {THREADS: {CONTEXT: {R: {B: steps_per_s}}}}}},
     "meta":     {"MODEL|DTYPE|THREADS|CONTEXT|R": {"raw_sps": {B: ...}, "cpu_model": ..., "warmup": ..., ...}},
     "dtype":    {"TARGET|DRAFTER|THREADS|DEVICE": {"tokens_per_s": {DTYPE: ...}, "cpu_model": ..., ...}}}

(all keys are strings in JSON). The stored curve is the medians made non-increasing in B (isotonic regression of
the step time): a bigger verify batch is never faster, and Algorithm 1's early stop relies on a unimodal Θ(B);
the raw medians are kept under ``meta``, with the processor that measured them (``cpu_model``, see
:func:`device_model`): a table from another processor is never used.

Loading: :func:`load_sps` gives a callable B -> steps/s for one (model, dtype, threads, context, R); between
measured B it interpolates the step time linearly; a B outside the measured range raises a ValueError naming the
range. Context lengths snap to the nearest measured bucket; R between measured values is interpolated (at the same
tokens per request q = B / R). :func:`sps_for_generate` is what ``generate()`` uses to turn the scheduler on by
default.

Profile on first use (:func:`ensure_profile`, when ``policy="scheduler"`` / ``"lagged"`` is asked for and nothing
is cached): a few B values (:func:`first_use_tokens`, the loader interpolates between them) and
:data:`FIRST_USE_REPEATS` repeats, so it takes seconds; it says once what it measures and where it writes. A
measurement that fails :func:`timing_problem` (repeats spread too wide, or a bigger B much faster than a smaller
one: another program was competing for the cores) is used for that call only and not cached. A table measured on
first use is marked ``"origin": "first use"`` and never changes the default policy of later programs: only a table
from an explicit act (``dspark profile``, or a program calling :func:`profile_target` and :func:`save_profile`)
turns the scheduler on by default. (Tables written before origins were recorded count as explicit.)

:func:`auto_dtype` (the ``--dtype auto`` of every command) times ``generate()`` in float32 and bfloat16 where the
processor leaves the choice open and caches the result in the same file (``"dtype"``).
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
    "ensure_profile",
    "first_use_tokens",
    "timing_problem",
    "sps_for_generate",
    "auto_dtype",
    "plot_profile",
]

PROFILE_FORMAT = "dspark-sps-profile/1"
QUICK_TOKENS = tuple(range(1, 18))
"""q values of the default R = 1 profile: B = 1..17 (block size 16 + the anchor)."""
BATCHED_TOKENS = (1, 2, 3, 5, 9, 17)
"""q values measured for R > 1 (B = R·q); the loader interpolates in between."""
DEFAULT_CONTEXTS = (256,)
"""Context lengths (tokens already in each request's KV cache) of the default quick profile."""
FIRST_USE_REPEATS = 3
"""Timed passes of a profile measured on first use (after one warm-up pass)."""
MAX_REPEAT_SPREAD = 0.5
"""A measurement is refused when the repeats of one B spread more than this fraction of their median."""
MAX_FASTER_AT_LARGER_B = 0.25
"""A measurement is refused when a larger B's median step time is more than this fraction below a smaller B's."""
FIRST_USE = "first use"
"""The ``origin`` recorded for tables measured on first use (they never change the default policy)."""


def first_use_tokens(block_size: int) -> tuple[int, ...]:
    """q values measured on first use for block size γ': those of :data:`BATCHED_TOKENS` up to γ' + 1, and γ' + 1
    (the largest verify of one request: γ' drafts + the anchor)."""
    return tuple(sorted({q for q in BATCHED_TOKENS if q <= block_size + 1} | {block_size + 1}))


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
    name, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:  # the first processor's entries
                if ln.startswith("model name") and name is None:
                    name = ln.split(":", 1)[1].strip()
                elif ln.startswith("flags") and not flags:
                    flags = set(ln.split(":", 1)[1].split())
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
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
    :func:`generation.scheduler.prefix_schedule` and :meth:`generation.policies.Policy.start`.
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
    from .packed_target import PackedTarget

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
        origin: recorded in ``meta``; ``"first use"`` (:data:`FIRST_USE`) keeps the table out of the default policy.

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
    tables: dict[int, dict[int, dict[int, float]]] = {}
    raw: dict[int, dict[int, dict[int, float]]] = {}
    problems: dict[int, dict[int, str]] = {}
    t_start = time.perf_counter()
    try:
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
    finally:
        torch.set_num_threads(old_threads)
    return {
        "model": target_name(target),
        "dtype": dtype_name(target.dtype),
        "threads": threads,
        "tables": tables,
        "raw": raw,
        "problems": problems,
        "meta": {
            "origin": origin,
            "warmup": warmup,
            "repeats": repeats,
            "device": str(target.device),
            "host": platform.node(),
            "cpu": platform.processor() or platform.machine(),
            "cpu_model": device_model(target.device),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "seconds": round(time.perf_counter() - t_start, 2),
        },
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
    include_first_use: bool = True,
) -> SPSProfile:
    """The stored :class:`SPSProfile` of (model, dtype, threads), measured on this processor (:func:`device_model`
    of ``device``: the CPU, or the GPU for a CUDA device); without ``include_first_use``, only the tables not
    measured on first use (module doc).

    Raises:
        FileNotFoundError: no profile file, none for this (model, dtype, threads), one measured on another
            processor (a copied cache, a home directory shared across machines), or (without
            ``include_first_use``) only tables measured on first use — the message says how to make one.
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
    meta = data.get("meta", {})
    tables = {int(c): {int(r): t for r, t in rs.items()
                       if include_first_use or meta.get(f"{target_name}|{dtype}|{int(threads)}|{c}|{r}", {}).get(
                           "origin") != FIRST_USE}
              for c, rs in node.items()}
    tables = {c: rs for c, rs in tables.items() if rs}
    if not tables:
        raise FileNotFoundError(
            f"the SPS profile for {target_name!r} / {dtype} / {threads} threads in {str(path)!r} was measured on "
            f"first use, which does not change the default policy; {hint}"
        )
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


def ensure_profile(
    target,
    *,
    contexts: Iterable[int] | None = None,
    requests: Iterable[int] = (1,),
    tokens: Sequence[int] | None = None,
    threads: int | None = None,
    path: str | os.PathLike | None = None,
    force: bool = False,
    warmup: int = 1,
    repeats: int = FIRST_USE_REPEATS,
    progress: Callable[[str], None] | None = None,
) -> SPSProfile:
    """Profile on first use: return the cached profile of ``target`` (its name, dtype; ``threads`` default the
    current torch setting), measuring the (context, R) entries that are missing (all with ``force``).

    What is measured is saved with ``"origin": "first use"`` (it never changes the default policy; module doc),
    after one warning naming what is measured and the file written. A measurement that fails
    :func:`timing_problem` is not saved: a warning gives the reason and the returned profile holds it for this
    caller only (its curves made non-increasing in B, as always).

    Args:
        contexts: context lengths (default :data:`DEFAULT_CONTEXTS`).
        requests: R values.
        tokens: q values (default those of :func:`profile_target`; :func:`first_use_tokens` for a few).
        threads, path, force, warmup, repeats, progress: as in :func:`profile_target` / :func:`save_profile`.
    """
    if contexts is None:
        contexts = DEFAULT_CONTEXTS
    threads = int(threads or torch.get_num_threads())
    name, dtype = target_name(target), dtype_name(target.dtype)
    contexts = sorted({int(c) for c in contexts})
    requests = sorted({int(r) for r in requests})
    need_q = max(tokens) if tokens else None
    try:
        prof = load_profile(name, dtype, threads, path, device=target.device)
    except FileNotFoundError:
        prof = None
    missing_ctx: dict[int, list[int]] = {}
    for c in contexts:
        for r in requests:
            have = prof.tables.get(c, {}).get(r) if prof is not None else None
            top = max(QUICK_TOKENS if r == 1 else BATCHED_TOKENS) if need_q is None else need_q
            if force or not have or max(have) < r * top:
                missing_ctx.setdefault(c, []).append(r)
    if not missing_ctx:
        return prof
    where = Path(path) if path is not None else default_profile_path()
    logger.warning("measuring SPS(B) of %s (%s, %d threads; context, R: %s) once, for the scheduler; writing %s. "
                   "Tables measured on first use do not change the default policy: `dspark profile` makes one that "
                   "does", name, dtype, threads, "; ".join(f"{c}, {rs}" for c, rs in missing_ctx.items()), where)
    refused: dict[int, dict[int, dict[int, float]]] = {}
    for c, rs in missing_ctx.items():
        result = profile_target(target, contexts=[c], requests=rs, tokens=tokens, threads=threads, warmup=warmup,
                                repeats=repeats, progress=progress, origin=FIRST_USE)
        for r, reason in result["problems"].get(c, {}).items():
            logger.warning("SPS(B) of %s at context %d, R=%d not cached: %s; used for this call only (`dspark "
                           "profile` on a quiet machine measures one to keep)", name, c, r, reason)
            refused.setdefault(c, {})[r] = result["tables"][c].pop(r)
        if any(result["tables"][c].values()):
            save_profile(result, where)
    try:
        prof = load_profile(name, dtype, threads, where, device=target.device)
        tables = {ctx: dict(rs) for ctx, rs in prof.tables.items()}
    except FileNotFoundError:
        tables = {}
    for c, rs in refused.items():
        tables.setdefault(c, {}).update(rs)
    return SPSProfile(name, dtype, threads, tables)


def sps_for_generate(
    target,
    drafter,
    context_len: int | None = None,
    *,
    block_size: int | None = None,
    threads: int | None = None,
    path: str | os.PathLike | None = None,
    profile_if_missing: bool = False,
) -> SPSCurve | None:
    """The SPS(B) curve ``generate(assistant_model=drafter)`` should schedule with (R = 1), or None.

    None when the drafter has no confidence head, when ``$DSPARK_SCHEDULER`` is ``0``/``off``, or when no cached
    profile for this target (name, dtype, thread count) covers B = 1 + block size. Without ``profile_if_missing``
    (the default policy) only a table made by an explicit act counts, never one measured on first use (module doc);
    with it (``scheduler`` / ``lagged`` asked for) any cached table counts, and a missing one is measured on first
    use (R = 1, B from :func:`first_use_tokens`, one context: seconds; :func:`ensure_profile`).
    Never raises for a missing or unreadable profile (returns None).
    """
    if getattr(drafter, "confidence_head", None) is None:
        return None
    if os.environ.get("DSPARK_SCHEDULER", "").strip().lower() in ("0", "off", "false", "no"):
        return None
    gamma = block_size or drafter.config.block_size
    threads = int(threads or torch.get_num_threads())
    name, dtype = target_name(target), dtype_name(target.dtype)
    try:
        prof = load_profile(name, dtype, threads, path, device=target.device, include_first_use=profile_if_missing)
    except (FileNotFoundError, ValueError):
        prof = None
    if prof is not None and not prof.covers(1, gamma + 1, context_len):
        prof = None
    if prof is None and profile_if_missing:
        prof = ensure_profile(target, requests=(1,), tokens=first_use_tokens(gamma), threads=threads, path=path)
    if prof is None:
        return None
    return prof.curve(1, context_len)


# ---------------------------------------------------------------------------------------------- dtype
DTYPE_PROMPT = "Write a Python function that returns the n-th Fibonacci number, then explain how it works."
"""The prompt :func:`auto_dtype` times ``generate()`` on (chat template applied)."""
DTYPE_MARGIN = 0.05
"""bfloat16 is chosen only when it runs more than this fraction faster than float32 (the token-exact mode)."""


def _dtype_key(target, drafter, threads: int, device) -> str:
    """``TARGET|DRAFTER|THREADS|DEVICE`` naming one measured job in the profile file's ``"dtype"`` section."""
    from modeling_dspark.target import DEFAULT_TARGET, PACKAGED_TARGETS

    t = str(target or DEFAULT_TARGET)
    t = t if t in PACKAGED_TARGETS else str(Path(t).expanduser().resolve())
    d = "plain" if drafter is None else (str(Path(drafter).resolve()) if Path(drafter).is_dir() else str(drafter))
    return f"{t}|{d}|{threads}|{torch.device(device).type}"


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


def auto_dtype(
    target: str | os.PathLike | None = None,
    drafter: str | os.PathLike | None = None,
    *,
    device="cpu",
    threads: int | None = None,
    path: str | os.PathLike | None = None,
    flags: frozenset[str] | None = None,
    max_new_tokens: int = 32,
    repeats: int = 2,
) -> tuple[torch.dtype, str]:
    """The faster dtype for ``generate()`` of ``target`` (with ``drafter``, or plain decoding) here, and why.

    The processor settles it where it can: bfloat16 on CUDA, float32 on a CPU without native bf16 matrix
    instructions (:func:`modeling_dspark.target.fast_dtype`: bf16 products are emulated there). On a CPU with them
    it depends on the processor and the job: a one-token step of a small target can run slower in bf16 than in fp32
    while a B-token verify runs faster. So both dtypes run the job itself — greedy ``generate()`` of
    :data:`DTYPE_PROMPT`, ``max_new_tokens`` tokens, with the drafter's default options — interleaved, ``repeats``
    times each, the fastest run kept; bfloat16 wins only when more than :data:`DTYPE_MARGIN` faster (float32 is
    the token-exact mode). The tokens/s are cached in the SPS profile file (:func:`default_profile_path`, section
    ``"dtype"``, keyed by target, drafter, threads and device type, with the processor): measured once, a few
    seconds for a small target; a cache entry from another processor is measured again, and a measurement taken
    while other programs kept every core busy (load average >= cores) is used once and not cached.

    Args:
        target: a target directory, a packaged target's name, or None for the default target.
        drafter: a drafter directory or Hub id, or None for plain decoding.
        device: ``"cpu"`` or a CUDA device.
        threads: torch CPU threads (default: the current setting), part of the cache key.
        path: the profile file (default :func:`default_profile_path`).
        flags: CPU flags (default: ``/proc/cpuinfo``'s), for tests.
        max_new_tokens, repeats: the size of the measurement (each >= 1).

    Returns:
        ``(dtype, reason)``: ``torch.float32`` or ``torch.bfloat16``, and one line saying why.

    Raises:
        ValueError: ``max_new_tokens`` or ``repeats`` < 1; errors of loading the target or drafter as they are.
    """
    from modeling_dspark.target import fast_dtype

    if max_new_tokens < 1 or repeats < 1:
        raise ValueError(f"max_new_tokens and repeats must be >= 1; got {max_new_tokens}, {repeats}")
    if torch.device(device).type == "cuda":
        return torch.bfloat16, "a GPU"
    if fast_dtype("cpu", flags) != torch.bfloat16:
        return torch.float32, "no native bf16 matrix instructions on this CPU"
    threads = int(threads or torch.get_num_threads())
    path = Path(path) if path is not None else default_profile_path()
    key, here = _dtype_key(target, drafter, threads, device), device_model(device)
    data = _read(path)
    entry = data.setdefault("dtype", {}).get(key)
    cached = entry is not None and entry.get("cpu_model") == here
    busy = ""
    if not cached:
        logger.warning("timing generate() in float32 and bfloat16 to pick the faster (%s; an explicit dtype skips "
                       "this); kept in %s unless every core is busy",
                       "plain decoding" if drafter is None else f"drafter {drafter}", path)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            rates = _time_generate(target, drafter, (torch.float32, torch.bfloat16), max_new_tokens, repeats, device)
        finally:
            torch.set_num_threads(old)
        entry = {"tokens_per_s": {k: round(v, 3) for k, v in rates.items()}, "cpu_model": here,
                 "max_new_tokens": max_new_tokens, "repeats": repeats, "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if load >= (os.cpu_count() or 1):  # other programs held every core: a measurement to use once, not keep
            busy = f"; the CPU was busy (load average {load:.1f}), so this is not cached"
        else:
            data = _read(path)  # re-read: keep what another process wrote meanwhile
            data.setdefault("dtype", {})[key] = entry
            _write(path, data)
    fp32, bf16 = entry["tokens_per_s"]["float32"], entry["tokens_per_s"]["bfloat16"]
    dtype = torch.bfloat16 if bf16 > fp32 * (1 + DTYPE_MARGIN) else torch.float32
    job = "plain generate()" if drafter is None else "generate() with this drafter"
    why = (f"{'measured' if not cached else 'measured before'} on this CPU for {job}: bfloat16 {bf16:.1f} tok/s, "
           f"float32 {fp32:.1f}" + ("" if dtype == torch.bfloat16 else
                                    f"; bfloat16 is not more than {DTYPE_MARGIN:.0%} faster") + busy)
    return dtype, why


# ---------------------------------------------------------------------------------------------- plotting
def plot_profile(profile: SPSProfile, out_png: str | os.PathLike, title: str | None = None) -> Path:
    """Plot SPS(B) and the step time for every (context, R) curve of ``profile`` into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ctx in profile.contexts:
        for r in profile.requests(ctx):
            pts = sorted(profile.tables[ctx][r].items())
            bs = [b for b, _ in pts]
            ax1.plot(bs, [s for _, s in pts], marker="o", ms=3, label=f"ctx {ctx}, R={r}")
            ax2.plot(bs, [1e3 / s for _, s in pts], marker="o", ms=3, label=f"ctx {ctx}, R={r}")
    ax1.set_xlabel("verify batch B (tokens)")
    ax1.set_ylabel("SPS(B)  (target steps / s)")
    ax2.set_xlabel("verify batch B (tokens)")
    ax2.set_ylabel("step time (ms)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or f"{profile.model}  {profile.dtype}  {profile.threads} threads")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
