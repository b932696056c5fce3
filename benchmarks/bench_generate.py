"""Benchmark: plain `generate()` vs `generate(assistant_model=dspark)` on the default target, bf16 and fp32.

Reports, per dtype: plain tokens/s (and the gpt-fast style bandwidth = target parameter bytes / per-token time),
DSpark tokens/s, speedup, τ (mean tokens committed per round), per-round T_draft / T_verify (ms, from the
generation statistics), and how many outputs are identical to plain `generate()` (must be all in fp32).
Also times 8 sequential Markov-head steps at ranks {16, 64, 256} in bf16 and fp32 (the cost that justifies
the default rank). Greedy decoding, one warm-up call per path before measuring.

    python benchmarks/bench_generate.py                       # random (untrained) drafter, 4 prompts, 64 tokens
    python benchmarks/bench_generate.py --drafter smollm2-135m-dspark --num-prompts 8
    python benchmarks/bench_generate.py --num-prompts 2 --max-new-tokens 32 --out /tmp/g.json
    python benchmarks/bench_generate.py --drafter smollm2-135m-dspark --policy scheduler --repeats 3 \
        --ranks ""                                            # paired passes, no Markov-head timing

Writes JSON to ``--out`` (default ``benchmarks/results/generate.json``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.stats import paired, paired_ratios  # noqa: E402  (after the path: run as a script)
from benchmarks.common import result_header, usable_cores, write_result  # noqa: E402

BUILTIN_PROMPTS = [
    "Explain in two sentences what speculative decoding is.",
    "Write a short Python function that checks whether a number is prime.",
    "List three facts about the Moon.",
    "Translate 'Good morning, how are you today?' into French and Spanish.",
    "What are the main causes of the seasons on Earth?",
    "Give me a recipe for a simple tomato pasta sauce.",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "Why is the sky blue?",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="random",
                   help="drafter directory, shipped drafter name or 'random' (untrained, seed 0)")
    p.add_argument("--target", default=None, help="target directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompts-file", default=None, help="JSON lines with a 'prompt' field (default: built-in)")
    p.add_argument("--num-prompts", type=int, default=4, help="use the first N prompts (default: 4)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=None, help="draft slots per round (default: the drafter's)")
    p.add_argument("--policy", default=None,
                   help="verify policy (dspark.generation.policies; default: generate()'s default, the scheduler when "
                        "the drafter has a confidence head, else full)")
    p.add_argument("--lookup", choices=("on", "off"), default="off",
                   help="the n-gram lookup proposer beside the drafter (generate()'s default is on; default here: off, "
                        "the drafter alone)")
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts (paired repetitions)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all usable cores)")
    p.add_argument("--ranks", default="16,64,256", help="Markov-head ranks to time")
    p.add_argument("--head-repeats", type=int, default=30, help="repeats of the 8-step Markov timing")
    p.add_argument("--skip-generate", action="store_true", help="only time the Markov head")
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "generate.json"))
    return p.parse_args(argv)


def load_prompts(args) -> list[str]:
    if args.prompts_file is None:
        prompts = list(BUILTIN_PROMPTS)
    else:
        prompts = []
        with open(args.prompts_file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        prompts.append(json.loads(line)["prompt"])
                    except (json.JSONDecodeError, KeyError, TypeError) as err:
                        sys.exit(f"{args.prompts_file}: line {lineno}: expected JSON with a 'prompt' field ({err})")
    return prompts[: args.num_prompts]


# ---------------------------------------------------------------------------------------------- generate()
def bench_dtype(args, dtype_name: str, prompts: list[str]) -> list[dict]:
    """Plain vs DSpark generate() on every prompt, ``--repeats`` passes.

    Every prompt runs plain and DSpark back to back (the order rotated per prompt), so drift of the machine hits both
    alike; DSpark's per-pass speedups are paired with plain decoding of the same pass."""
    import torch

    from dspark.pairing import load_models
    from dspark.evaluation.eval_sets import timed_generate
    from dspark.generation import collect_stats, dspark_options
    from modeling_dspark.target import apply_chat_template

    target, tok, drafter = load_models(args.target, args.drafter_dir, dtype_name)
    param_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    gen = {"max_new_tokens": args.max_new_tokens, "do_sample": False,
           "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id}
    encoded = [torch.tensor([apply_chat_template(tok, p)]) for p in prompts]
    variants = ["dspark"]

    def options():
        opts = {"policy": args.policy, "block_size": args.block_size}
        if args.lookup == "off":  # the drafter alone, no second proposer
            opts["lookup"] = False
        return dspark_options(**opts)

    def run(ids, key, kw=gen):
        """One greedy generate() call: (new token ids, seconds, GenerationStats or None)."""
        if key is None:
            return timed_generate(target, ids, None, kw, None)
        with torch.inference_mode(), options(), collect_stats() as stats:
            t0 = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, **kw)
            seconds = time.perf_counter() - t0
        return out[0, ids.shape[1]:].tolist(), seconds, stats[-1]

    warm = dict(gen, max_new_tokens=min(16, args.max_new_tokens))  # one-time costs (allocator, kernels, profiling)
    for key in [None] + variants:
        run(encoded[0], key, warm)

    keys = [None] + variants
    runs = {k: [] for k in keys}  # per key: (pass, prompt index, ids, seconds, stats)
    for rep in range(args.repeats):
        for i, ids in enumerate(encoded):
            shift = (rep + i) % len(keys)
            for key in keys[shift:] + keys[:shift]:
                out_ids, secs, stats = run(ids, key)
                runs[key].append((rep, i, out_ids, secs, stats))
    plain = runs[None]
    plain_tok = sum(len(r[2]) for r in plain)
    plain_s = sum(r[3] for r in plain)
    s_per_token = plain_s / max(1, plain_tok)
    results = []
    for key in variants:
        mine = runs[key]
        rounds = [rd for r in mine for rd in r[4].rounds]
        n_rounds = max(1, len(rounds))
        ds_tok, ds_s = sum(len(r[2]) for r in mine), sum(r[3] for r in mine)
        def s_per_token_of_pass(recs, rep):
            return sum(r[3] for r in recs if r[0] == rep) / max(1, sum(len(r[2]) for r in recs if r[0] == rep))

        plain_spt = [s_per_token_of_pass(plain, rep) for rep in range(args.repeats)]
        mine_spt = [s_per_token_of_pass(mine, rep) for rep in range(args.repeats)]
        per_pass = paired_ratios(mine_spt, plain_spt)  # plain s/token over DSpark's: > 1 where DSpark was faster
        # one-sided: the chance of this many faster passes or more if DSpark were no faster
        test = paired(plain_spt, mine_spt, alternative="greater")
        faster = test["won"]
        results.append({
            "dtype": dtype_name,
            "policy": args.policy,
            "lookup": args.lookup,
            "target_param_bytes": param_bytes,
            "drafter": args.drafter,
            "drafter_config": {k: getattr(drafter.config, k) for k in
                               ("block_size", "num_draft_layers", "sequential_head", "markov_rank",
                                "use_confidence_head", "target_layer_ids")},
            "block_size": args.block_size or drafter.config.block_size,
            "prompts": len(prompts),
            "repeats": args.repeats,
            "plain_tokens_per_s": plain_tok / plain_s,
            "plain_ms_per_token": 1e3 * s_per_token,
            "plain_bandwidth_GBps": param_bytes / s_per_token / 1e9,
            "dspark_tokens_per_s": ds_tok / ds_s,
            "speedup": (ds_tok / ds_s) / (plain_tok / plain_s),
            "speedup_per_pass": per_pass,
            "faster_passes": faster,
            "sign_p": test["p"],
            "tau": sum(r.committed for r in rounds) / n_rounds,
            "rounds": len(rounds),
            "skipped_draft_rounds": sum(r.drafted == 0 for r in rounds),
            "acceptance_per_drafted": sum(r.accepted for r in rounds) / max(1, sum(r.drafted for r in rounds)),
            "t_draft_ms": sum(r.t_draft_ms for r in rounds) / n_rounds,
            "t_verify_ms": sum(r.t_verify_ms for r in rounds) / n_rounds,
            "identical": sum(a[2] == b[2] for a, b in zip(plain, mine)),
            "outputs": len(mine),
        })
    return results


# ---------------------------------------------------------------------------------------------- Markov head
def bench_markov(args, vocab_size: int, dtype_name: str, rank: int | None) -> dict:
    """8 sequential head steps as in drafting: B_k = W_2 W_1[x_{k−1}], add to U_k, argmax → x_k feeds step k+1.

    ``rank=None`` times the same loop without a head (just U_k argmax), the floor the head adds to.
    """
    import torch

    from modeling_dspark.heads import MarkovHead

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, vocab_size, generator=g)
    head = None
    if rank is not None:
        head = MarkovHead(vocab_size, rank).to(dtype)
        with torch.no_grad():
            head.out.weight.normal_(0, 0.02, generator=g)  # untrained W_2 is zero; use a real-looking one

    def steps():
        prev = torch.tensor([1])
        for k in range(8):
            logits = base[k : k + 1]
            if head is not None:
                bias, _ = head.step(prev, None, None)
                logits = logits + bias.float()
            prev = logits.argmax(-1)
        return prev

    times = []
    with torch.inference_mode():
        for _ in range(3):
            steps()
        for _ in range(args.head_repeats):
            t0 = time.perf_counter()
            steps()
            times.append(time.perf_counter() - t0)
    return {"dtype": dtype_name, "rank": rank, "ms_8_steps_median": 1e3 * statistics.median(times),
            "ms_8_steps_min": 1e3 * min(times), "flops_per_step": 2 * (rank or 0) * vocab_size}


# ---------------------------------------------------------------------------------------------- report
def markdown(result: dict) -> str:
    lines = []
    gen = result.get("generate", [])
    if gen:
        g0 = gen[0]
        lines += [
            f"Target {result['target']}, drafter `{g0['drafter']}` (block size {g0['block_size']}), "
            f"{g0['prompts']} prompts × {result['settings']['max_new_tokens']} new tokens, greedy, "
            f"torch threads: {result['machine']['torch_threads']}, CPU: {result['machine']['cpu']}.",
            "",
            "| dtype | plain tok/s | plain ms/tok | plain GB/s | DSpark tok/s | speedup | faster passes "
            "(sign p) | τ | rounds without drafting | T_draft ms | T_verify ms | identical |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for g in gen:
            lines.append(
                f"| {g['dtype']} | {g['plain_tokens_per_s']:.1f} | "
                f"{g['plain_ms_per_token']:.1f} | {g['plain_bandwidth_GBps']:.2f} | {g['dspark_tokens_per_s']:.1f} | "
                f"{g['speedup']:.2f}× | {g['faster_passes']}/{g['repeats']} (p={g['sign_p']:.2g}) | {g['tau']:.2f} | "
                f"{g['skipped_draft_rounds']}/{g['rounds']} | {g['t_draft_ms']:.1f} | {g['t_verify_ms']:.1f} | "
                f"{g['identical']}/{g['outputs']} |"
            )
        lines.append("")
    heads = result.get("markov_head", [])
    if heads:
        step_ms = {g["dtype"]: g["plain_ms_per_token"] for g in gen}
        lines += ["Markov head, 8 sequential steps (W_1 lookup → W_2 → add → argmax), V = "
                  f"{result['vocab_size']}:", "",
                  "| dtype | rank | ms / 8 steps (median) | min | % of a plain target step |", "|---|---|---|---|---|"]
        for h in heads:
            pct = f"{100 * h['ms_8_steps_median'] / step_ms[h['dtype']]:.0f}%" if h["dtype"] in step_ms else "–"
            rank = "none (argmax only)" if h["rank"] is None else h["rank"]
            lines.append(f"| {h['dtype']} | {rank} | {h['ms_8_steps_median']:.2f} | {h['ms_8_steps_min']:.2f} | {pct} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    prompts = load_prompts(args)
    try:
        if os.getloadavg()[0] >= usable_cores():
            print(f"[bench] warning: load average {os.getloadavg()[0]:.1f} on {usable_cores()} cores: other processes "
                  "compete for the CPU and multi-threaded timings can be off by 10-100x (try --threads 1 or a "
                  "quiet machine)", file=sys.stderr)
    except OSError:
        pass
    from dspark.pairing import InputError, drafter_dir, target_for_drafter

    try:
        # a directory, shipped name or Hub id, checked before the target loads; the JSON records it as given
        args.drafter_dir = args.drafter if args.drafter == "random" else drafter_dir(args.drafter)
        args.target = target_for_drafter(args.target, args.drafter_dir)
    except InputError as err:
        sys.exit(str(err))

    from modeling_dspark.target import DEFAULT_TARGET, target_dir

    result = {
        **result_header("generate", argv, threads),
        "target": args.target or DEFAULT_TARGET,
        "settings": {"max_new_tokens": args.max_new_tokens, "greedy": True, "warmup_calls_per_path": 1,
                     "block_size": args.block_size, "dtypes": dtypes, "policy": args.policy,
                     "lookup": args.lookup, "repeats": args.repeats},
        "generate": [],
        "markov_head": [],
    }
    if not args.skip_generate:
        for dt in dtypes:
            print(f"[bench] generate, {dt} ...", file=sys.stderr, flush=True)
            result["generate"].extend(bench_dtype(args, dt, prompts))
    from transformers import AutoConfig

    result["vocab_size"] = AutoConfig.from_pretrained(target_dir(args.target)).vocab_size
    for dt in dtypes:
        for rank in ([None] + [int(r) for r in args.ranks.split(",") if r.strip()]) if args.ranks.strip() else []:
            result["markov_head"].append(bench_markov(args, result["vocab_size"], dt, rank))
    write_result(result, markdown(result), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
