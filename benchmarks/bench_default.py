"""Benchmark: the default `generate(assistant_model=drafter)` and the default engine against plain decoding, paired.

`generate()` arm: for every held-out prompt (math: GSM8K, code: HumanEval, chat: MT-Bench / AlpacaEval alternating),
plain greedy `generate()` and the default DSpark call (no options) run back to back, their order alternating from
prompt to prompt, in the same dtype; outputs are compared token for token. Per domain: tokens/s of each (total
tokens over total seconds), their ratio, how many prompts ran faster with DSpark, and a two-sided sign test of
that count (scipy's binomtest). ``--temperature T`` samples instead (``do_sample=True``, T, transformers' other
defaults; both arms seeded alike per prompt): the arms' outputs then differ, and so may their lengths.

Engine arm (``--engine-requests``): for each R, a stream of ``--engine-waves`` × R prompts, all queued at the start,
served with at most R in flight by :class:`dspark.generation.DSparkEngine` with the drafter (default policy) and without
(plain batched decoding: no drafter, no lookup), ``--repeats`` repetitions interleaved; the ratio per repetition and
the sign test over repetitions. Request i asks for 24 + (37·i mod 49) new tokens (24..72, mean about
``--engine-tokens`` = 48), as requests of a server differ in length; ``--engine-equal-lengths`` gives every request
``--engine-tokens``, so that plain decoding admits and retires the requests in lock-step waves while speculation
staggers them (the drain at the end then runs with few requests in flight).

``--background-load N`` runs N single-threaded busy-loop processes beside the whole benchmark (another job holding
cores): both arms share the load, and the policy's measured prices see the contention of a shared machine.

    python benchmarks/bench_default.py --target SmolLM2-135M-Instruct --per-domain 8 --max-new-tokens 96 \\
        --dtypes float32,bfloat16 --engine-requests 1,4,16 --out benchmarks/results/default/smollm2.json

Writes JSON to ``--out`` and prints a markdown table; names the processor.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.stats import paired, paired_ratios  # noqa: E402  (after the path: run as a script)
from benchmarks.common import (  # noqa: E402
    device_name, load_domain_prompts, result_header, usable_cores, write_result)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="SmolLM2-135M-Instruct", help="packaged target name or directory")
    p.add_argument("--drafter", default=None, help="drafter (default: the target's shipped drafter)")
    p.add_argument("--per-domain", type=int, default=8, help="prompts per domain (default: 8)")
    p.add_argument("--offset", type=int, default=0, help="skip the first N prompts of each eval set")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature in the generate() arm (default 0: greedy)")
    p.add_argument("--engine-requests", default="", help="comma-separated R values for the engine arm (default: none)")
    p.add_argument("--engine-tokens", type=int, default=48, help="new tokens per engine request, mean (default: 48)")
    p.add_argument("--engine-waves", type=int, default=4, help="engine requests per R in flight (default: 4)")
    p.add_argument("--engine-equal-lengths", action="store_true",
                   help="every engine request asks for exactly --engine-tokens (default: 24..72, see above)")
    p.add_argument("--repeats", type=int, default=3, help="engine repetitions (default: 3)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all usable cores)")
    p.add_argument("--device", default="cpu", help="where the models run, e.g. cuda (default: cpu)")
    p.add_argument("--background-load", type=int, default=0,
                   help="single-threaded busy-loop processes, each keeping one core busy during the run (default: 0)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.engine_tokens < 2 or args.engine_waves < 1:
        p.error("--engine-tokens must be >= 2 and --engine-waves >= 1")
    if args.background_load < 0:
        p.error("--background-load must be >= 0")
    return args


def _busy_loop() -> None:
    while True:
        pass


@contextlib.contextmanager
def background_load(num: int):
    """``num`` daemon processes, each keeping one core busy, for the duration of the ``with`` block."""
    import multiprocessing

    procs = [multiprocessing.Process(target=_busy_loop, daemon=True) for _ in range(num)]
    try:
        for proc in procs:
            proc.start()
        yield
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join()


def generate_arm(target, tok, drafter, prompts: dict, max_new: int, temperature: float = 0.0) -> dict:
    import torch

    from dspark.evaluation.eval_sets import timed_generate
    from modeling_dspark.target import apply_chat_template

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    gen = {"max_new_tokens": max_new, "do_sample": temperature > 0, "pad_token_id": pad}
    if temperature > 0:
        gen["temperature"] = temperature
    encoded = [(d, p, torch.tensor([apply_chat_template(tok, p["prompt"])], device=target.device))
               for d, ps in prompts.items() for p in ps]
    for drafter_or_none in (None, drafter, drafter):  # warm-up: kernels, and the first rounds' prices
        timed_generate(target, encoded[0][2], drafter_or_none, dict(gen, max_new_tokens=min(24, max_new)))
    records = []
    for i, (domain, prompt, ids) in enumerate(encoded):
        runs = {}
        for variant in (("plain", "dspark") if i % 2 == 0 else ("dspark", "plain")):
            new, seconds, stats = timed_generate(target, ids, drafter if variant == "dspark" else None, gen, seed=i)
            runs[variant] = (new, seconds, stats)
        (p_ids, p_s, _), (d_ids, d_s, stats) = runs["plain"], runs["dspark"]
        rounds = stats.rounds if stats else []
        records.append({
            "domain": domain, "id": prompt["id"], "new_tokens": len(p_ids), "dspark_tokens": len(d_ids),
            "plain_s": p_s, "dspark_s": d_s,
            "identical": d_ids == p_ids, "rounds": len(rounds), "tau": stats.tau if stats else None,
            "draft_rounds": sum(r.source == "draft" for r in rounds),
            "lookup_rounds": sum(r.source == "lookup" for r in rounds),
            "plain_rounds": sum(r.source == "" for r in rounds),
            "t_draft_ms": sum(r.t_draft_ms for r in rounds if r.drafted) / max(1, sum(r.drafted > 0 for r in rounds)),
        })
        r = records[-1]
        (d_rate,), (p_rate,) = _rates([r])
        print(f"[bench] {domain} {prompt['id']}: plain {p_rate:.1f} tok/s, dspark {d_rate:.1f} ({d_rate / p_rate:.2f}x, "
              f"τ {r['tau'] or 0:.2f}, draft/lookup/plain rounds {r['draft_rounds']}/{r['lookup_rounds']}/"
              f"{r['plain_rounds']}, identical {r['identical']})", file=sys.stderr, flush=True)
    domains = {}
    for d in prompts:
        recs = [r for r in records if r["domain"] == d]
        test = paired(*_rates(recs))  # won: DSpark faster
        plain = sum(r["new_tokens"] for r in recs) / sum(r["plain_s"] for r in recs)
        dspark = sum(r["dspark_tokens"] for r in recs) / sum(r["dspark_s"] for r in recs)
        domains[d] = {"prompts": len(recs), "plain_tok_s": plain, "dspark_tok_s": dspark, "ratio": dspark / plain,
                      "faster": test["won"], "sign_p": test["p"],
                      "identical": sum(r["identical"] for r in recs),
                      "tau": sum(r["tau"] or 0 for r in recs) / len(recs),
                      "draft_rounds": sum(r["draft_rounds"] for r in recs),
                      "lookup_rounds": sum(r["lookup_rounds"] for r in recs),
                      "plain_rounds": sum(r["plain_rounds"] for r in recs),
                      "t_draft_ms": sum(r["t_draft_ms"] for r in recs) / len(recs)}
    test = paired(*_rates(records))
    macro = {"ratio": sum(x["ratio"] for x in domains.values()) / len(domains), "faster": test["won"],
             "prompts": len(records), "sign_p": test["p"]}
    return {"domains": domains, "macro": macro, "per_prompt": records}


def _rates(records: list[dict]) -> tuple[list[float], list[float]]:
    """Per prompt: DSpark's tokens/s and plain decoding's (the arms' lengths differ under sampling)."""
    return ([r["dspark_tokens"] / r["dspark_s"] for r in records], [r["new_tokens"] / r["plain_s"] for r in records])


def engine_lengths(num: int, mean: int, equal: bool) -> list[int]:
    """New tokens of each of ``num`` engine requests: ``mean`` each, or spread over mean ± mean/2 (module doc)."""
    return [mean] * num if equal else [mean // 2 + (37 * i) % (mean + 1) for i in range(num)]


def engine_arm(target, tok, drafter, prompts: dict, levels: list[int], max_new: int, repeats: int, waves: int = 4,
               equal: bool = False):
    """Yields ``(R, stats)`` for each R in ``levels``, in order, as each is measured."""
    from dspark.generation import DSparkEngine
    from modeling_dspark.target import apply_chat_template

    pool = [apply_chat_template(tok, p["prompt"]) for ps in zip(*prompts.values()) for p in ps]

    def serve(engine, batch) -> float:
        for ids, n in zip(batch, engine_lengths(len(batch), max_new, equal)):
            engine.add_request(ids, n)
        t0 = time.perf_counter()
        outs = engine.run()
        return sum(o.num_tokens for o in outs) / (time.perf_counter() - t0)

    for r in levels:
        engines = {"dspark": DSparkEngine(target, drafter, max_batch_size=r),
                   "plain": DSparkEngine(target, None, policy="none", lookup=False, max_batch_size=r)}
        batch = [pool[i % len(pool)] for i in range(waves * r)]
        for e in engines.values():  # warm-up, and the drafter's first prices
            serve(e, batch[: max(1, r)])
        rates = {"dspark": [], "plain": []}
        for rep in range(repeats):
            for name in (("plain", "dspark") if rep % 2 == 0 else ("dspark", "plain")):
                rates[name].append(serve(engines[name], batch))
        test = paired(rates["dspark"], rates["plain"])
        print(f"[bench] engine R={r}: plain {rates['plain']}, dspark {rates['dspark']} tok/s", file=sys.stderr,
              flush=True)
        yield r, {"plain_tok_s": rates["plain"], "dspark_tok_s": rates["dspark"],
                  "ratios": paired_ratios(rates["plain"], rates["dspark"]),
                  "ratio": sum(rates["dspark"]) / sum(rates["plain"]), "faster": test["won"], "sign_p": test["p"]}


def _decoding(settings: dict) -> str:
    t = settings.get("temperature") or 0
    return f"sampled at temperature {t:g} (outputs not comparable)" if t else "greedy"


def markdown(result: dict) -> str:
    limits = result.get("machine", {}).get("kernel_limits") or result.get("isa_limit")  # older results: isa_limit
    limit = "; kernels limited by " + ", ".join(f"{k}={v}" for k, v in limits.items()) if limits else ""
    load = result["settings"].get("background_load")
    limit += f"; {load} busy-loop process(es) beside the run" if load else ""
    lines = [f"Processor: {result['processor']}{limit}; torch threads {result['threads']}; target {result['target']}, "
             f"drafter {result['drafter']}; {result['settings']['per_domain']} prompts per domain × "
             f"{result['settings']['max_new_tokens']} new tokens, {_decoding(result['settings'])}.", "",
             "| dtype | domain | plain tok/s | default tok/s | × plain | faster | sign p | τ "
             "| rounds draft/lookup/plain | identical |", "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for run in result["runs"]:
        g = run["generate"]
        for d, x in g["domains"].items():
            lines.append(f"| {run['dtype']} | {d} | {x['plain_tok_s']:.1f} | {x['dspark_tok_s']:.1f} | "
                         f"{x['ratio']:.2f}× | {x['faster']}/{x['prompts']} | {x['sign_p']:.3f} | {x['tau']:.2f} | "
                         f"{x['draft_rounds']}/{x['lookup_rounds']}/{x['plain_rounds']} | "
                         f"{x['identical']}/{x['prompts']} |")
        m = g["macro"]
        lines.append(f"| {run['dtype']} | **macro** | | | **{m['ratio']:.2f}×** | {m['faster']}/{m['prompts']} | "
                     f"{m['sign_p']:.3f} | | | |")
    if any(run.get("engine") for run in result["runs"]):
        st = result["settings"]
        lengths = (f"{st['engine_tokens']} new tokens each" if st.get("engine_equal_lengths", "engine_waves" not in st)
                   else f"{st['engine_tokens'] // 2}..{st['engine_tokens'] * 3 // 2} new tokens")
        lines += ["", f"Engine: {st.get('engine_waves', 2)}·R requests queued at the start, {lengths}.", "",
                  "| dtype | engine R | plain tok/s | with drafter tok/s | × plain | faster | sign p |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for run in result["runs"]:
            for r, x in (run.get("engine") or {}).items():
                lines.append(f"| {run['dtype']} | {r} | {sum(x['plain_tok_s']) / len(x['plain_tok_s']):.1f} | "
                             f"{sum(x['dspark_tok_s']) / len(x['dspark_tok_s']):.1f} | {x['ratio']:.2f}× | "
                             f"{x['faster']}/{len(x['ratios'])} | {x['sign_p']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers.utils import logging as hf_logging

    from dspark.evaluation.profiling import cpu_model
    from dspark.pairing import load_models
    from modeling_dspark.target import shipped_drafter_for

    hf_logging.disable_progress_bar()
    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    drafter_spec = args.drafter or str(shipped_drafter_for(args.target))
    prompts = load_domain_prompts(args.per_domain, args.offset)
    levels = [int(x) for x in args.engine_requests.split(",") if x.strip()]
    result = {**result_header("default", argv, threads), "processor": cpu_model(),
              "device": device_name(args.device),
              "threads": threads,
              "target": args.target, "drafter": drafter_spec,
              "settings": {"per_domain": args.per_domain, "offset": args.offset,
                           "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                           "engine_tokens": args.engine_tokens,
                           "engine_waves": args.engine_waves, "engine_equal_lengths": args.engine_equal_lengths,
                           "repeats": args.repeats, "background_load": args.background_load,
                           "prompt_ids": {d: [p["id"] for p in ps]
                                                                   for d, ps in prompts.items()}},
              "runs": []}
    with background_load(args.background_load):
        for dt in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            print(f"[bench] {dt} ...", file=sys.stderr, flush=True)
            target, tok, drafter = load_models(args.target, drafter_spec, dt, args.device)
            run = {"dtype": dt, "generate": generate_arm(target, tok, drafter, prompts, args.max_new_tokens,
                                                         args.temperature)}
            result["runs"].append(run)
            write_result(result, markdown(result), args.out, final=False)
            for r, stats in engine_arm(target, tok, drafter, prompts, levels, args.engine_tokens, args.repeats,
                                       args.engine_waves, args.engine_equal_lengths):
                run.setdefault("engine", {})[r] = stats
                write_result(result, markdown(result), args.out, final=False)
            del target, drafter
    write_result(result, markdown(result), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
