"""Acceptance length, per-position acceptance and wall-clock speed-up of a drafter on held-out eval sets.

For every eval set (:func:`dspark.training.prompts.load_eval_prompts`; chat template applied) and prompt,
:func:`evaluate` runs:

* **greedy** — ``target.generate(ids, assistant_model=drafter)`` (the drafter alone, no lookup proposer) and, with
  ``speed``, plain ``target.generate(ids)`` and transformers' built-in prompt-lookup decoding
  (``prompt_lookup_num_tokens``) on the same prompt, interleaved per prompt (their order rotates from prompt to
  prompt) after one warm-up call of each. Speed-up = DSpark tokens/s ÷ plain tokens/s over the whole set. Greedy
  DSpark output is compared with plain output token for token.
* **sample** — the same with T = 1 sampling (seed + prompt index), for τ.

Reported per set and mode: τ = committed tokens / speculative rounds (the paper's acceptance length; the prefill
is not a round), ``tokens_per_target_forward`` = new tokens / target forward calls counted with a forward hook (the
τ-equivalent of the prompt-lookup row; it includes the prefill), the conditional acceptance rate of each position k
(P(x_k accepted | x_<k accepted)), the survival P(x_1..x_k accepted) and the implied τ for block size k
(1 + Σ_{j≤k} survival_j). :func:`markdown` renders a report (``dspark eval`` also plots it).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import numpy as np
import torch

from dspark.evaluation.profiling import synchronize

__all__ = ["MODES", "MIN_SPEED_PROMPTS", "ForwardCounter", "timed_generate", "evaluate", "markdown"]

MODES = ("greedy", "sample")
MIN_SPEED_PROMPTS = 8
"""Speed-ups from fewer prompts (each timed once) are marked as noise: load and warm-up decide them."""


class ForwardCounter:
    """Counts the forward calls of a module (here: the target) with a forward hook; :meth:`remove` detaches it."""

    def __init__(self, module):
        self.n = 0
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1

    def remove(self):
        self._handle.remove()


def timed_generate(target, ids, drafter, gen_kwargs: dict, seed: int | None = None, block_size=None, policy=None,
                   lookup: bool = True):
    """One timed ``target.generate()`` call, with ``assistant_model=drafter`` unless ``drafter`` is None.

    Args:
        target: the target model.
        ids: ``[1, P]`` long prompt ids on the target's device.
        drafter: a bound :class:`modeling_dspark.DSparkDraftModel`, or None for plain decoding (or, with
            ``prompt_lookup_num_tokens`` in ``gen_kwargs``, transformers' prompt lookup).
        gen_kwargs: ``generate()`` keyword arguments (``attention_mask`` is added).
        seed: ``torch.manual_seed`` before the call (None: leave the generator).
        block_size, policy, lookup: :func:`dspark.generation.dspark_options` of a drafter's call (None: its defaults).

    Returns:
        ``(new token ids: list[int], seconds: float, GenerationStats | None)``; the stats of a drafter's call (None
        without a drafter, or if ``generate()`` ran no DSpark round loop). The time includes a CUDA synchronize.
    """
    from dspark.generation import collect_stats, dspark_options

    if seed is not None:
        torch.manual_seed(seed)
    kw = dict(gen_kwargs, attention_mask=torch.ones_like(ids))
    options = contextlib.nullcontext()
    if drafter is not None:
        kw["assistant_model"] = drafter
        options = dspark_options(policy=policy, block_size=block_size, lookup=lookup)
    with torch.inference_mode(), collect_stats() as runs, options:
        synchronize(ids.device)
        t0 = time.perf_counter()
        out = target.generate(ids, **kw)
        synchronize(ids.device)
        dt = time.perf_counter() - t0
    stats = runs[-1] if runs and drafter is not None else None
    return out[0, ids.shape[1]:].tolist(), dt, stats


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def _summarise_speed(records: list[dict]) -> dict:
    tokens = sum(len(r["ids"]) for r in records)
    secs = sum(r["seconds"] for r in records)
    fwd = sum(r["forwards"] for r in records)
    return {"n_prompts": len(records), "new_tokens": tokens, "seconds": secs,
            "tokens_per_s": tokens / secs if secs > 0 else None, "target_forwards": fwd,
            "tokens_per_target_forward": tokens / fwd if fwd else None}


def _summarise_dspark(records: list[dict], gamma: int, eos: list[int]) -> dict:
    from dspark.evaluation.acceptance import acceptance_by_position, acceptance_matrix, ends_with_committed_eos

    rounds = [r["rounds"] or [] for r in records]
    labels = [acceptance_matrix(rs, gamma, eos, ends_with_committed_eos(r["ids"], rs, eos))
              for r, rs in zip(records, rounds)]
    acc = np.concatenate([a for a, _ in labels]) if labels else np.zeros((0, gamma), dtype=np.int8)
    valid = np.concatenate([v for _, v in labels]) if labels else np.zeros((0, gamma), dtype=bool)
    flat = [x for rs in rounds for x in rs]
    n_rounds = [len(rs) for rs in rounds]  # per prompt
    committed = [sum(x.committed for x in rs) for rs in rounds]  # per prompt
    out = _summarise_speed(records)
    out.update(rounds=len(flat), tau=sum(committed) / len(flat) if flat else None,
               tau_mean_per_prompt=_mean([c / n for c, n in zip(committed, n_rounds) if n]),
               drafted=int(sum(x.drafted for x in flat)), accepted=int(sum(x.accepted for x in flat)),
               t_draft_ms=_mean([x.t_draft_ms for x in flat]), t_verify_ms=_mean([x.t_verify_ms for x in flat]),
               per_position=acceptance_by_position(acc, valid),
               per_prompt={"rounds": n_rounds, "committed": committed})
    return out


def _encoded_prompts(target, tok, sets: list[str], limit: int | None) -> dict[str, list[torch.Tensor]]:
    """The ``[1, P]`` prompt ids (chat template applied, on the target's device) of each eval set, first ``limit``."""
    from modeling_dspark.target import apply_chat_template
    from dspark.training.prompts import load_eval_prompts

    return {name: [torch.tensor([apply_chat_template(tok, p["prompt"])], device=target.device)
                   for p in load_eval_prompts(name, limit)] for name in sets}


def _call_runner(target, drafter, counter: ForwardCounter, block_size, policy, pld_num_tokens: int):
    """``run(kind, ids, kw, seed=None)``: one timed call of ``kind`` ("dspark": the drafter alone, no lookup
    proposer; "plain"; "pld": prompt lookup with ``pld_num_tokens``), returning its new ids, seconds, target
    forwards (counted by ``counter``) and rounds."""

    def run(kind: str, ids, kw: dict, seed=None) -> dict:
        n0 = counter.n
        if kind == "pld":
            kw = dict(kw, prompt_lookup_num_tokens=pld_num_tokens)
        new, dt, stats = timed_generate(target, ids, drafter if kind == "dspark" else None, kw, seed, block_size,
                                        policy, lookup=False)  # the drafter alone: τ and acceptance are its own
        return {"ids": new, "seconds": dt, "forwards": counter.n - n0, "rounds": stats.rounds if stats else None}

    return run


def _warm_up(run, ids, timed: list[str], greedy_kw: dict, sample_kw: dict | None, seed: int) -> None:
    """One short call of each timed kind (``run`` of :func:`evaluate`; plain first) and, with ``sample_kw``, one
    sampled DSpark call, so that no timing includes a first call's one-time costs."""
    warm = dict(greedy_kw, max_new_tokens=min(8, greedy_kw["max_new_tokens"]))
    for kind in ("plain", "dspark", "pld"):
        if kind in timed:
            run(kind, ids, warm)
    if sample_kw is not None:
        run("dspark", ids, dict(sample_kw, max_new_tokens=min(8, sample_kw["max_new_tokens"])), seed)


def _greedy_rows(run, prompts: list, timed: list[str], greedy_kw: dict, gamma: int, eos: list[int],
                 pld_num_tokens: int, bar) -> dict:
    """Greedy rows of one eval set: each prompt run once by each kind in ``timed`` (``run`` of :func:`evaluate`),
    the order rotated from prompt to prompt to interleave fairly; ``{"plain", "prompt_lookup", "greedy"}`` (the
    rows that ran), greedy with its speed-up and identity check against plain decoding."""
    recs: dict[str, list] = {"dspark": [], "plain": [], "pld": []}
    for i, ids in enumerate(prompts):
        for kind in timed[i % len(timed):] + timed[: i % len(timed)]:  # rotated to interleave fairly
            recs[kind].append(run(kind, ids, greedy_kw))
        bar.update(1)
    rows: dict = {}
    g = _summarise_dspark(recs["dspark"], gamma, eos)
    if "plain" in timed:
        base = _summarise_speed(recs["plain"])
        same = [d["ids"] == b["ids"] for d, b in zip(recs["dspark"], recs["plain"])]
        g.update(speedup=_ratio(g["tokens_per_s"], base["tokens_per_s"]), n_identical=sum(same),
                 all_identical=all(same), differing_prompts=[i for i, s in enumerate(same) if not s])
        rows["plain"] = base
        if "pld" in timed:
            p = _summarise_speed(recs["pld"])
            same_p = [d["ids"] == b["ids"] for d, b in zip(recs["pld"], recs["plain"])]
            p.update(speedup=_ratio(p["tokens_per_s"], base["tokens_per_s"]), n_identical=sum(same_p),
                     num_tokens=pld_num_tokens)
            rows["prompt_lookup"] = p
    rows["greedy"] = g
    return rows


def _sample_row(run, prompts: list, sample_kw: dict, seed: int, gamma: int, eos: list[int], bar) -> dict:
    """The T = 1 row of one eval set: a sampled DSpark call per prompt (``run`` of :func:`evaluate`; prompt i
    seeded ``seed + i``), summarised as :func:`_summarise_dspark`."""
    recs = []
    for i, ids in enumerate(prompts):
        recs.append(run("dspark", ids, sample_kw, seed + i))
        bar.update(1)
    return _summarise_dspark(recs, gamma, eos)


def evaluate(target, tok, drafter, sets: list[str], modes: list[str], limit: int | None = None,
             block_size: int | None = None, policy: str = "full", max_new_tokens: int = 128, seed: int = 0,
             speed: bool = True, pld: bool = True, pld_num_tokens: int = 10, progress: bool = False) -> dict:
    """Run the evaluation of the module doc.

    Args:
        target, tok: the target and its tokenizer; drafter: a bound drafter.
        sets: eval set names (:data:`dspark.training.prompts.EVAL_SETS`); modes: a subset of :data:`MODES`.
        limit: first N prompts of each set (None: all).
        block_size, policy: the drafter's :func:`dspark.generation.dspark_options` (block size None: the drafter's).
        max_new_tokens: per call; seed: sampling seed (prompt i: ``seed + i``).
        speed: also time plain decoding (speed-up, identity check); pld: and prompt lookup with
            ``pld_num_tokens``.
        progress: a tqdm bar per set on stderr.

    Returns:
        ``{"results": {set: {"n_prompts", "greedy", "sample", "plain", "prompt_lookup"}}, "summary": {...}}``:
        per mode the tokens, seconds, tokens/s, target forwards, τ, drafted/accepted counts, mean draft and
        verify ms per round, :func:`dspark.evaluation.acceptance.acceptance_by_position` and ``per_prompt``
        (``{"rounds", "committed"}``: lists in prompt order, for paired comparisons of two drafters:
        ``benchmarks/paired_eval.py``); greedy adds ``speedup``, ``n_identical``, ``all_identical`` and
        ``differing_prompts``. The summary holds macro τ per mode, tokens/s per row, speed-ups, identity counts and
        ``speedup_is_noise`` (fewer than :data:`MIN_SPEED_PROMPTS` prompts).

    Raises:
        ValueError: an unknown eval set; dspark.training.prompts.DataPackageMissing: its data package is missing.
    """
    from tqdm.auto import tqdm

    from dspark.training.data import eos_token_ids

    gamma = block_size or drafter.config.block_size
    eos = eos_token_ids(target, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else None)
    greedy_kw = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": pad}
    sample_kw = dict(greedy_kw, do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    counter = ForwardCounter(target)
    data = _encoded_prompts(target, tok, sets, limit)
    run = _call_runner(target, drafter, counter, block_size, policy, pld_num_tokens)
    timed = ["dspark"] + (["plain"] + (["pld"] if pld else []) if speed else [])
    results: dict = {}
    try:
        first = next(x for xs in data.values() for x in xs)
        _warm_up(run, first, timed, greedy_kw, sample_kw if "sample" in modes else None, seed)
        for name in sets:
            prompts = data[name]
            res: dict = {"n_prompts": len(prompts)}
            bar = tqdm(total=len(prompts) * len(modes), desc=f"eval {name}", disable=not progress, file=sys.stderr)
            if "greedy" in modes:
                res.update(_greedy_rows(run, prompts, timed, greedy_kw, gamma, eos, pld_num_tokens, bar))
            if "sample" in modes:
                res["sample"] = _sample_row(run, prompts, sample_kw, seed, gamma, eos, bar)
            bar.close()
            results[name] = res
    finally:
        counter.remove()
    return {"results": results, "summary": _overall(results, modes)}


def _overall(results: dict, modes: list[str]) -> dict:
    out: dict = {}
    for mode in modes:
        out[f"tau_{mode}_macro"] = _mean([r[mode]["tau"] for r in results.values()
                                          if r.get(mode) and r[mode]["tau"] is not None])
    for row, key in (("greedy", "dspark"), ("plain", "plain"), ("prompt_lookup", "prompt_lookup")):
        rs = [r[row] for r in results.values() if row in r]
        if rs:
            tokens, secs = sum(r["new_tokens"] for r in rs), sum(r["seconds"] for r in rs)
            out[f"{key}_tokens_per_s"] = tokens / secs if secs > 0 else None
    if "plain_tokens_per_s" in out:
        out["speedup"] = _ratio(out.get("dspark_tokens_per_s"), out["plain_tokens_per_s"])
        out["prompt_lookup_speedup"] = _ratio(out.get("prompt_lookup_tokens_per_s"), out["plain_tokens_per_s"])
        g = [r["greedy"] for r in results.values() if "greedy" in r]
        out["n_identical"] = sum(x["n_identical"] for x in g)
        out["n_compared"] = sum(x["n_prompts"] for x in g)
        out["speedup_is_noise"] = out["n_compared"] < MIN_SPEED_PROMPTS
    return out


# ---------------------------------------------------------------------------------------------- rendering
def _f(v, fmt="{:.2f}"):
    return fmt.format(v) if v is not None else "–"


def _speedup(v, n_prompts: int) -> str:
    """A speed-up cell; marked "(noise)" when measured on fewer than :data:`MIN_SPEED_PROMPTS` prompts."""
    return _f(v, "{:.2f}×") + (" (noise)" if v is not None and n_prompts < MIN_SPEED_PROMPTS else "")


def markdown(report: dict) -> str:
    """The markdown tables of an eval report (``{"config", "results", "summary"}``, ``config`` as ``dspark eval``
    writes it): τ, speed-ups (marked "(noise)" below :data:`MIN_SPEED_PROMPTS` prompts) and per-position
    conditional acceptance."""
    cfg, results, summ = report["config"], report["results"], report["summary"]
    lines = [
        f"# dspark eval: {cfg['drafter']} on {cfg['target']}",
        "",
        f"{cfg['dtype']}, {cfg['device']}, block size {cfg['block_size']}, policy {cfg['policy']}, "
        f"max {cfg['max_new_tokens']} new tokens, limit {cfg['limit'] or 'all'} per set, "
        f"{cfg['machine']['torch_threads']} CPU threads.",
        "",
        "τ = committed tokens per speculative round; tok/fwd = new tokens per target forward (incl. prefill); "
        "speedup = tokens/s over plain `generate()` in the same run (greedy).",
        "",
        "| set | n | τ greedy | τ T=1 | tok/fwd | DSpark tok/s | plain tok/s | speedup | identical | "
        "PLD tok/fwd | PLD speedup |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        g, s, b, p = r.get("greedy", {}), r.get("sample", {}), r.get("plain", {}), r.get("prompt_lookup", {})
        ident = f"{g['n_identical']}/{g['n_prompts']}" if "n_identical" in g else "–"
        lines.append(
            f"| {name} | {r['n_prompts']} | {_f(g.get('tau'))} | {_f(s.get('tau'))} | "
            f"{_f(g.get('tokens_per_target_forward'))} | {_f(g.get('tokens_per_s'), '{:.1f}')} | "
            f"{_f(b.get('tokens_per_s'), '{:.1f}')} | {_speedup(g.get('speedup'), r['n_prompts'])} | {ident} | "
            f"{_f(p.get('tokens_per_target_forward'))} | {_speedup(p.get('speedup'), r['n_prompts'])} |"
        )
    macro = " ".join(f"τ {m} (macro) {_f(summ.get(f'tau_{m}_macro'))};" for m in ("greedy", "sample")
                     if f"tau_{m}_macro" in summ)
    n_all = summ.get("n_compared", 0)
    lines += ["", f"Overall: {macro} speedup {_speedup(summ.get('speedup'), n_all)}, "
                  f"prompt lookup {_speedup(summ.get('prompt_lookup_speedup'), n_all)}.", ""]
    if any(r["n_prompts"] < MIN_SPEED_PROMPTS for r in results.values()) and "speedup" in summ:
        lines += [f"(noise): a speed-up from fewer than {MIN_SPEED_PROMPTS} prompts, each timed once, is decided by "
                  f"other load and warm-up, not by the drafter; use --limit {MIN_SPEED_PROMPTS} or more to measure "
                  "speed.", ""]
    gamma = cfg["block_size"]
    lines += ["Conditional acceptance rate P(x_k accepted | x_<k accepted):", "",
              "| set | mode | " + " | ".join(f"k={k}" for k in range(1, gamma + 1)) + " |",
              "|---|---|" + "---:|" * gamma]
    for name, r in results.items():
        for mode in MODES:
            if mode in r:
                pp = r[mode]["per_position"]["conditional_accept_rate"]
                lines.append(f"| {name} | {mode} | " + " | ".join(_f(v) for v in pp) + " |")
    lines += ["", f"Command: `{cfg['command']}`", ""]
    return "\n".join(lines)
