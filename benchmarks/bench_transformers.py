"""Benchmark: dspark's default against transformers' own speculation, paired, on held-out prompts.

Four arms per prompt, greedy, the same dtype, their order rotating from prompt to prompt:

- ``plain``: ``target.generate()``;
- ``dflash``: transformers' native DFlash loop (``speculation_type="dflash"``) with the shipped DSpark drafter's
  backbone (:class:`modeling_dspark.dflash.DFlashAssistant`): the full block verified every round, no dspark code
  deciding anything;
- ``pld``: transformers' prompt lookup (``prompt_lookup_num_tokens``, default 10);
- ``dspark``: the default ``generate(assistant_model=drafter)``.

Per domain and arm: tokens/s (the arm's total new tokens over its total seconds), the ratio to plain's, τ as new
tokens per target forward (1 for plain; every arm counted the same way, prefill included), outputs identical to
plain; per domain, how many prompts dspark ran faster (seconds per token) than each other arm and a two-sided sign
test of that count.

    python benchmarks/bench_transformers.py --target SmolLM2-135M-Instruct --per-domain 8 --max-new-tokens 96 \\
        --dtypes float32,bfloat16 --out benchmarks/results/transformers/smollm2.json

Writes JSON to ``--out`` and prints a markdown table; names the processor and the transformers release.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.stats import paired  # noqa: E402  (after the path: run as a script)
from benchmarks.common import (  # noqa: E402
    device_name, load_domain_prompts, result_header, usable_cores, write_result)

ARMS = ("plain", "dflash", "pld", "dspark")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="SmolLM2-135M-Instruct", help="packaged target name or directory")
    p.add_argument("--drafter", default=None, help="drafter (default: the target's shipped drafter)")
    p.add_argument("--per-domain", type=int, default=8, help="prompts per domain (default: 8)")
    p.add_argument("--offset", type=int, default=0, help="skip the first N prompts of each eval set")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--arms", default=",".join(ARMS),
                   help=f"the arms to run, comma-separated (default: all of {','.join(ARMS)}; plain and dspark always)")
    p.add_argument("--pld-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens (default 10)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all usable cores)")
    p.add_argument("--device", default="cpu", help="where the models run, e.g. cuda (default: cpu)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.per_domain < 1 or args.max_new_tokens < 2 or args.pld_tokens < 1:
        p.error("--per-domain and --pld-tokens must be >= 1, --max-new-tokens >= 2")
    arms = {a.strip() for a in args.arms.split(",") if a.strip()}
    if arms - set(ARMS) or not {"plain", "dspark"} <= arms:
        p.error(f"--arms takes some of {', '.join(ARMS)}, plain and dspark included; got {args.arms!r}")
    args.arms = tuple(a for a in ARMS if a in arms)
    return args


def run_arm(arm: str, target, drafter, ids, gen: dict, pld_tokens: int) -> tuple[list[int], float, int]:
    """One timed greedy call of ``arm``: ``(new token ids, seconds, target forwards)``."""
    import torch

    from modeling_dspark.dflash import DFlashAssistant

    kw = dict(gen, attention_mask=torch.ones_like(ids))
    if arm == "dflash":
        kw.update(assistant_model=DFlashAssistant(drafter), speculation_type="dflash")
    elif arm == "pld":
        kw.update(prompt_lookup_num_tokens=pld_tokens)
    elif arm == "dspark":
        kw.update(assistant_model=drafter)
    forwards = [0]
    hook = target.register_forward_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = target.generate(ids, **kw)
            if ids.is_cuda:
                torch.cuda.synchronize(ids.device)
            seconds = time.perf_counter() - t0
    finally:
        hook.remove()
    return out[0, ids.shape[1]:].tolist(), seconds, forwards[0]


def generate_arms(target, tok, drafter, prompts: dict, max_new: int, pld_tokens: int, arms=ARMS) -> dict:
    """Every arm of ``arms`` on every prompt, their order rotating; per domain the module doc's figures."""
    arms = tuple(arms)
    import torch

    from modeling_dspark.target import apply_chat_template

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    gen = {"max_new_tokens": max_new, "do_sample": False, "pad_token_id": pad}
    encoded = [(d, p, torch.tensor([apply_chat_template(tok, p["prompt"])], device=target.device))
               for d, ps in prompts.items() for p in ps]
    for arm in arms + ("dspark",):  # warm-up: kernels, and the default's first prices
        run_arm(arm, target, drafter, encoded[0][2], dict(gen, max_new_tokens=min(24, max_new)), pld_tokens)
    records = []
    for i, (domain, prompt, ids) in enumerate(encoded):
        rec = {"domain": domain, "id": prompt["id"]}
        order = arms[i % len(arms):] + arms[: i % len(arms)]
        outs = {}
        for arm in order:
            outs[arm], rec[f"{arm}_s"], rec[f"{arm}_forwards"] = run_arm(arm, target, drafter, ids, gen, pld_tokens)
        rec["new_tokens"] = len(outs["plain"])
        for arm in arms:  # an arm's own count: in bfloat16 an output may part from plain's and end elsewhere
            rec[f"{arm}_tokens"] = len(outs[arm])
        for arm in arms[1:]:
            rec[f"{arm}_identical"] = outs[arm] == outs["plain"]
        records.append(rec)
        print(f"[bench] {domain} {prompt['id']}: " + ", ".join(
            f"{a} {rec[f'{a}_tokens'] / rec[f'{a}_s']:.1f} tok/s τ {rec[f'{a}_tokens'] / rec[f'{a}_forwards']:.2f}"
            for a in arms), file=sys.stderr, flush=True)
    domains = {}
    for d in prompts:
        recs = [r for r in records if r["domain"] == d]
        x = {"prompts": len(recs)}
        plain_rate = sum(r["plain_tokens"] for r in recs) / sum(r["plain_s"] for r in recs)
        for arm in arms:
            tokens, seconds = sum(r[f"{arm}_tokens"] for r in recs), sum(r[f"{arm}_s"] for r in recs)
            x[arm] = {"tok_s": tokens / seconds, "ratio": tokens / seconds / plain_rate,
                      "tau": tokens / sum(r[f"{arm}_forwards"] for r in recs),
                      "identical": len(recs) if arm == "plain" else sum(r[f"{arm}_identical"] for r in recs)}
        for arm in arms[:-1]:  # dspark against each other arm, prompt by prompt, in seconds per token
            test = paired([r[f"{arm}_s"] / max(1, r[f"{arm}_tokens"]) for r in recs],
                          [r["dspark_s"] / max(1, r["dspark_tokens"]) for r in recs])  # won: dspark faster
            x[f"dspark_vs_{arm}"] = {"faster": test["won"], "sign_p": test["p"]}
        domains[d] = x
    macro = {arm: sum(x[arm]["ratio"] for x in domains.values()) / len(domains) for arm in arms}
    return {"domains": domains, "macro_ratio": macro, "per_prompt": records}


def markdown(result: dict) -> str:
    limits = result.get("machine", {}).get("kernel_limits")
    held = f" (kernels held by {', '.join(f'{k}={v}' for k, v in limits.items())})" if limits else ""
    lines = [f"Processor: {result['processor']}{held}; transformers {result['transformers']}; torch threads "
             f"{result['threads']}; target {result['target']}, drafter {result['drafter']}; "
             f"{result['settings']['per_domain']} prompts per domain × {result['settings']['max_new_tokens']} new "
             "tokens, greedy. τ = new tokens per target forward; × = speed over plain; dspark faster = prompts "
             "where the default beat that arm (sign p).", "",
             "| dtype | domain | plain tok/s | transformers DFlash tok/s (×, τ) | prompt lookup tok/s (×, τ) "
             "| dspark default tok/s (×, τ) | dspark faster than DFlash / lookup / plain |",
             "|---|---|---:|---:|---:|---:|---|"]

    def cell(x):
        return f"{x['tok_s']:.1f} ({x['ratio']:.2f}×, {x['tau']:.2f})" if x else "—"

    def faster(x, a):
        return f"{x[f'dspark_vs_{a}']['faster']}/{x['prompts']} (p {x[f'dspark_vs_{a}']['sign_p']:.3f})" \
            if f"dspark_vs_{a}" in x else "—"

    def macro(m, a):
        return f"**{m[a]:.2f}×**" if a in m else "—"

    for run in result["runs"]:
        for d, x in run["domains"].items():
            vs = " / ".join(faster(x, a) for a in ("dflash", "pld", "plain"))
            lines.append(f"| {run['dtype']} | {d} | {x['plain']['tok_s']:.1f} | {cell(x.get('dflash'))} "
                         f"| {cell(x.get('pld'))} | {cell(x['dspark'])} | {vs} |")
        m = run["macro_ratio"]
        lines.append(f"| {run['dtype']} | **macro ×** | | {macro(m, 'dflash')} | {macro(m, 'pld')} | "
                     f"{macro(m, 'dspark')} | |")
    lines.append("")
    for run in result["runs"]:
        total = sum(x["prompts"] for x in run["domains"].values())
        same = ", ".join(f"{a} {sum(x[a]['identical'] for x in run['domains'].values())}/{total}"
                         for a in ARMS[1:] if a in run["macro_ratio"])
        lines.append(f"Outputs identical to plain in {run['dtype']}: {same}.")
    lines.append("float32 is token-exact; in bfloat16 a batched verify rounds differently from a one-token step, so "
                 "outputs can part at near-ties.")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    from dspark.evaluation.profiling import cpu_model
    from dspark.pairing import load_models
    from modeling_dspark.target import shipped_drafter_for

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    drafter_spec = args.drafter or str(shipped_drafter_for(args.target))
    prompts = load_domain_prompts(args.per_domain, args.offset)
    result = {**result_header("transformers", argv, threads), "processor": cpu_model(),
              "device": device_name(args.device), "transformers": transformers.__version__, "threads": threads,
              "target": args.target, "drafter": drafter_spec,
              "settings": {"per_domain": args.per_domain, "offset": args.offset, "max_new_tokens": args.max_new_tokens,
                           "pld_tokens": args.pld_tokens, "arms": list(args.arms),
                           "prompt_ids": {d: [p["id"] for p in ps] for d, ps in prompts.items()}},
              "runs": []}
    for dt in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        print(f"[bench] {dt} ...", file=sys.stderr, flush=True)
        target, tok, drafter = load_models(args.target, drafter_spec, dt, args.device)
        result["runs"].append({"dtype": dt, **generate_arms(target, tok, drafter, prompts, args.max_new_tokens,
                                                            args.pld_tokens, args.arms)})
        write_result(result, markdown(result), args.out, final=False)
        del target, drafter
    write_result(result, markdown(result), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
