"""Benchmark: plain `generate()`, transformers' prompt lookup, DSpark, and DSpark + lookup, on held-out prompts.

One process; for every prompt the four variants run back to back (their order rotated from prompt to prompt), so
drift of a shared machine hits all alike. Greedy decoding. Prompts: math (GSM8K), code (HumanEval) and chat
(MT-Bench first turns, then AlpacaEval, alternating), the project's held-out eval sets (dspark.training.prompts).

Per prompt and variant: new tokens, seconds, target forwards, τ (tokens per target forward after the prefill, i.e.
per round), per-round draft / verify ms (DSpark variants), lookup rounds, and whether the output equals plain
`generate()`. Per dtype and domain: tokens/s and the ratios vs plain and vs prompt lookup; the macro ratio is the
mean of the three domain ratios. Memory bandwidth: the target's weight bytes × target forwards per second (each
forward reads every weight once), against the machine's limit measured here (a large tensor copy and a large
read, same thread count).

    python benchmarks/bench_proposers.py --drafter smollm2-135m-dspark --per-domain 4 --max-new-tokens 96
    python benchmarks/bench_proposers.py --per-domain 2 --max-new-tokens 64 --dtypes float32 --out /tmp/p.json

Writes JSON to ``--out`` (default ``benchmarks/results/proposers.json``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import DOMAINS, load_domain_prompts, result_header, usable_cores, write_result  # noqa: E402
VARIANTS = ("plain", "prompt_lookup", "dspark", "dspark+lookup")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="smollm2-135m-dspark", help="drafter directory, shipped drafter name or 'random'")
    p.add_argument("--target", default=None, help="target directory or packaged target name (default: the drafter's "
                   "target if it is a packaged target or a local directory, else SmolLM2-135M-Instruct)")
    p.add_argument("--per-domain", type=int, default=4, help="prompts per domain (default: 4)")
    p.add_argument("--offset", type=int, default=0, help="skip the first N prompts of each eval set (default: 0)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated: bfloat16, float32")
    p.add_argument("--policy", default="scheduler", help="DSpark verify policy (dspark.generation.policies)")
    p.add_argument("--pld-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens (default 10)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all usable cores)")
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "proposers.json"))
    return p.parse_args(argv)


def measure_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> dict:
    """The machine's memory bandwidth at ``threads`` torch threads, GB/s (best of ``repeats``).

    ``copy``: dst.copy_(src) of ``mib`` MiB, counting the bytes read and written; ``read``: src.sum(), the bytes
    read (what a weight-streaming forward does)."""
    import torch

    n = mib * (1 << 20) // 4
    src, dst = torch.ones(n), torch.empty(n)
    copy_s, read_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        src.sum()
        read_s.append(time.perf_counter() - t0)
    nbytes = n * 4
    return {"buffer_MiB": mib, "threads": threads, "copy_GBps": 2 * nbytes / min(copy_s) / 1e9,
            "read_GBps": nbytes / min(read_s) / 1e9}


def run_variant(variant, target, ids, drafter, gen, counter, args) -> dict:
    """One timed call of ``variant``: new ids, seconds, target forwards and rounds (none for plain and lookup)."""
    from dspark.evaluation.eval_sets import timed_generate

    n0 = counter.n
    if variant == "prompt_lookup":
        gen = dict(gen, prompt_lookup_num_tokens=args.pld_tokens)
    new, dt, stats = timed_generate(target, ids, None if variant in ("plain", "prompt_lookup") else drafter, gen,
                                    policy=args.policy, lookup=variant == "dspark+lookup")
    return {"ids": new, "seconds": dt, "forwards": counter.n - n0, "rounds": stats.rounds if stats else []}


def _record(domain, prompt, variant, run, plain_ids) -> dict:
    rounds = run.get("rounds") or []
    n = len(run["ids"])
    rec = {"domain": domain, "id": prompt["id"], "variant": variant, "new_tokens": n, "seconds": run["seconds"],
           "tokens_per_s": n / run["seconds"], "target_forwards": run["forwards"],
           # the first forward is the prefill, which commits one token; every later one is a round
           "tau": (n - 1) / max(1, run["forwards"] - 1) if n > 1 else None,
           "identical_to_plain": None if plain_ids is None else run["ids"] == plain_ids}
    if rounds:
        rec.update(rounds=len(rounds), t_draft_ms=sum(r.t_draft_ms for r in rounds) / len(rounds),
                   t_verify_ms=sum(r.t_verify_ms for r in rounds) / len(rounds),
                   drafted_rounds=sum(r.drafted > 0 for r in rounds),
                   lookup_rounds=sum(getattr(r, "source", "") == "lookup" for r in rounds))
    return rec


def _rate(recs) -> float:
    secs = sum(r["seconds"] for r in recs)
    return sum(r["new_tokens"] for r in recs) / secs if secs > 0 else float("nan")


def summarise(records: list[dict], param_bytes: int) -> dict:
    """Per domain and variant: tokens/s, τ, ms, bandwidth; ratios vs plain and vs prompt lookup; macro over domains."""
    out: dict = {"domains": {}, "macro": {}}
    domains = sorted({r["domain"] for r in records}, key=list(DOMAINS).index)
    for d in domains:
        per = {}
        for v in VARIANTS:
            recs = [r for r in records if r["domain"] == d and r["variant"] == v]
            if not recs:
                continue
            secs = sum(r["seconds"] for r in recs)
            fwd = sum(r["target_forwards"] for r in recs)
            tok = sum(r["new_tokens"] for r in recs)
            rounds = [r for r in recs if "rounds" in r]
            per[v] = {"prompts": len(recs), "new_tokens": tok, "seconds": secs, "tokens_per_s": tok / secs,
                      "tau": (tok - len(recs)) / max(1, fwd - len(recs)),
                      "target_forwards_per_s": fwd / secs,
                      "achieved_GBps": param_bytes * fwd / secs / 1e9,
                      "identical_to_plain": sum(bool(r["identical_to_plain"]) for r in recs)}
            if rounds:
                n_rounds = sum(r["rounds"] for r in rounds)
                per[v].update(t_draft_ms=sum(r["t_draft_ms"] * r["rounds"] for r in rounds) / n_rounds,
                              t_verify_ms=sum(r["t_verify_ms"] * r["rounds"] for r in rounds) / n_rounds,
                              drafted_rounds=sum(r["drafted_rounds"] for r in rounds),
                              lookup_rounds=sum(r["lookup_rounds"] for r in rounds), rounds=n_rounds)
        for v in per:
            per[v]["vs_plain"] = per[v]["tokens_per_s"] / per["plain"]["tokens_per_s"]
            if "prompt_lookup" in per:
                per[v]["vs_prompt_lookup"] = per[v]["tokens_per_s"] / per["prompt_lookup"]["tokens_per_s"]
        out["domains"][d] = per
    for v in VARIANTS:
        doms = [out["domains"][d][v] for d in domains if v in out["domains"][d]]
        if doms:
            out["macro"][v] = {k: sum(x[k] for x in doms) / len(doms) for k in ("vs_plain", "vs_prompt_lookup")
                               if all(k in x for x in doms)}
    return out


def bench_dtype(args, dtype_name: str, prompts: dict[str, list[dict]]) -> dict:
    import torch

    from dspark.pairing import load_models
    from dspark.evaluation.eval_sets import ForwardCounter
    from modeling_dspark.target import apply_chat_template

    target, tok, drafter = load_models(args.target, args.drafter_dir, dtype_name)
    param_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    gen = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": pad}
    counter = ForwardCounter(target)
    records = []
    try:
        encoded = [(d, p, torch.tensor([apply_chat_template(tok, p["prompt"])]))
                   for d, ps in prompts.items() for p in ps]
        warm = dict(gen, max_new_tokens=min(16, args.max_new_tokens))  # one-time costs (kernels, SPS profiling)
        for v in VARIANTS:
            run_variant(v, target, encoded[0][2], drafter, warm, counter, args)
        for i, (domain, prompt, ids) in enumerate(encoded):
            order = VARIANTS[i % len(VARIANTS):] + VARIANTS[: i % len(VARIANTS)]
            runs = {v: run_variant(v, target, ids, drafter, gen, counter, args) for v in order}
            for v in VARIANTS:
                records.append(_record(domain, prompt, v, runs[v], runs["plain"]["ids"] if v != "plain" else None))
            print(f"[bench] {dtype_name} {domain} {prompt['id']}: " + ", ".join(
                f"{v} {records[-len(VARIANTS) + k]['tokens_per_s']:.1f}" for k, v in enumerate(VARIANTS))
                + " tok/s", file=sys.stderr, flush=True)
    finally:
        counter.remove()
    return {"dtype": dtype_name, "target_param_bytes": param_bytes, "summary": summarise(records, param_bytes),
            "per_prompt": records}


def markdown(result: dict) -> str:
    bw = result["bandwidth_limit"]
    lines = [f"CPU: {result['machine']['cpu']}, torch threads {result['machine']['torch_threads']}; "
             f"{result['settings']['per_domain']} prompts per domain × {result['settings']['max_new_tokens']} new "
             f"tokens, greedy; policy `{result['settings']['policy']}`; measured memory bandwidth: copy "
             f"{bw['copy_GBps']:.1f} GB/s, read {bw['read_GBps']:.1f} GB/s.", "",
             "| dtype | domain | variant | tok/s | vs plain | vs prompt lookup | τ | T_draft ms | T_verify ms | "
             "lookup rounds | GB/s (% of read) | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        s = run["summary"]
        for d, per in s["domains"].items():
            for v, x in per.items():
                ms = (f"{x['t_draft_ms']:.1f} | {x['t_verify_ms']:.1f} | {x['lookup_rounds']}/{x['rounds']}"
                      if "rounds" in x else "– | – | –")
                ident = "–" if v == "plain" else f"{x['identical_to_plain']}/{x['prompts']}"
                lines.append(f"| {run['dtype']} | {d} | {v} | {x['tokens_per_s']:.1f} | {x['vs_plain']:.2f}× | "
                             f"{x.get('vs_prompt_lookup', float('nan')):.2f}× | {x['tau']:.2f} | {ms} | "
                             f"{x['achieved_GBps']:.1f} ({100 * x['achieved_GBps'] / bw['read_GBps']:.0f}%) | "
                             f"{ident} |")
        for v, m in s["macro"].items():
            lines.append(f"| {run['dtype']} | **macro** | {v} | | {m.get('vs_plain', float('nan')):.2f}× | "
                         f"{m.get('vs_prompt_lookup', float('nan')):.2f}× | | | | | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers.utils import logging as hf_logging

    from dspark.generation import dspark_options
    from modeling_dspark.target import DEFAULT_TARGET

    if "lookup" not in inspect.signature(dspark_options).parameters:
        sys.exit("this checkout's dspark_options has no lookup= option (the lookup proposer is not wired in)")
    from dspark.pairing import InputError, drafter_dir, target_for_drafter

    try:
        # a directory, shipped name or Hub id, checked before the target loads; the JSON records it as given
        args.drafter_dir = args.drafter if args.drafter == "random" else drafter_dir(args.drafter)
        args.target = target_for_drafter(args.target, args.drafter_dir)
    except InputError as err:
        sys.exit(str(err))
    if args.per_domain < 1 or args.max_new_tokens < 2:
        sys.exit("--per-domain must be >= 1 and --max-new-tokens >= 2")
    hf_logging.disable_progress_bar()
    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    prompts = load_domain_prompts(args.per_domain, args.offset)
    result = {
        **result_header("proposers", argv, threads),
        "bandwidth_limit": measure_bandwidth(threads),
        "target": args.target or DEFAULT_TARGET,
        "drafter": args.drafter,
        "settings": {"per_domain": args.per_domain, "offset": args.offset, "max_new_tokens": args.max_new_tokens,
                     "greedy": True, "policy": args.policy, "prompt_lookup_num_tokens": args.pld_tokens,
                     "domains": {d: list(s) for d, s in DOMAINS.items()}, "variants": list(VARIANTS),
                     "prompt_ids": {d: [p["id"] for p in ps] for d, ps in prompts.items()}},
        "runs": [],
    }
    for dt in dtypes:
        print(f"[bench] {dt} ...", file=sys.stderr, flush=True)
        result["runs"].append(bench_dtype(args, dt, prompts))
    result["bandwidth_limit_at_end"] = measure_bandwidth(threads)
    write_result(result, markdown(result), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
