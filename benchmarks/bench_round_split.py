"""Benchmark: where one round of the default `generate(assistant_model=drafter)` spends its time, R = 1.

Greedy on held-out prompts (the bench's domains), after one warm-up call. Each round's wall time is split into

- ``target_forward``: the target's verify forward (a forward hook on the target);
- ``drafter_forward``: the drafter's block forward, context ingestion included (a hook on the drafter; the first
  round ingests the whole prompt);
- ``drafting_rest``: the rest of the round's drafting (sequential head, LM-head product, confidences, the verify
  policy, the lookup: the round's ``t_draft_ms`` less the drafter forward);
- ``loop``: everything else (transformers' assisted loop: acceptance, cache crop, stopping criteria; the features
  handed to the drafter; the round's record),

in ms per round (a round is a target forward after the prefill) and in plain steps (a plain `generate()` of the same
prompts, run interleaved with the default, gives the plain step: its seconds per new token). The prefill forwards
are excluded from both sides.

    python benchmarks/bench_round_split.py --per-domain 2 --max-new-tokens 96 --dtype bfloat16 --threads 1 \\
        --out benchmarks/results/default/round-split.json

Writes JSON to ``--out`` and prints a markdown table; names the processor.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import load_domain_prompts, result_header, usable_cores, write_result  # noqa: E402

PARTS = ("target_forward", "drafter_forward", "drafting_rest", "loop")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="SmolLM2-135M-Instruct", help="packaged target name or directory")
    p.add_argument("--per-domain", type=int, default=2, help="prompts per domain (default: 2)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all usable cores)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.per_domain < 1 or args.max_new_tokens < 2 or (args.threads is not None and args.threads < 1):
        p.error("--per-domain and --threads must be >= 1 and --max-new-tokens >= 2")
    return args


class _Timer:
    """Seconds a module spends in its forward calls, from a pre-hook and a hook (calls counted)."""

    def __init__(self, module):
        self.seconds, self.calls, self._t0 = 0.0, 0, 0.0
        self._handles = [module.register_forward_pre_hook(self._start), module.register_forward_hook(self._stop)]

    def _start(self, *_):
        self._t0 = time.perf_counter()

    def _stop(self, *_):
        self.seconds += time.perf_counter() - self._t0
        self.calls += 1

    def remove(self):
        for h in self._handles:
            h.remove()


def split_call(target, drafter, ids, max_new: int) -> dict:
    """One default greedy call: seconds of each part (module doc) summed over its rounds, the rounds, new tokens."""
    import torch

    from dspark.generation import collect_stats

    # the prefill is the first target forward: the wall time counts from its end, as plain_step's does
    target_t, drafter_t = _Timer(target), _Timer(drafter)
    first = {}

    def end_of_prefill(*_):  # hooks run in the order registered: the timer's has already counted this forward
        first.setdefault("s", target_t.seconds)
        first.setdefault("t", time.perf_counter())

    prefill = target.register_forward_hook(end_of_prefill)
    try:
        with torch.inference_mode(), collect_stats() as runs:
            out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                  max_new_tokens=max_new, do_sample=False)
            wall = time.perf_counter() - first["t"]
    finally:
        prefill.remove()
        target_t.remove()
        drafter_t.remove()
    t_draft = sum(r.t_draft_ms for r in runs[-1].rounds) / 1e3
    parts = {"target_forward": target_t.seconds - first["s"], "drafter_forward": drafter_t.seconds,
             "drafting_rest": t_draft - drafter_t.seconds}
    parts["loop"] = wall - sum(parts.values())
    return {"parts": parts, "rounds": target_t.calls - 1, "new_tokens": out.shape[1] - ids.shape[1], "wall": wall}


def plain_step(target, ids, max_new: int) -> tuple[float, int]:
    """Seconds of a plain greedy call after its prefill, and its decoding steps."""
    import torch

    first = {}

    def end_of_prefill(*_):
        first.setdefault("s", time.perf_counter())

    hook = target.register_forward_hook(end_of_prefill)
    try:
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
            end = time.perf_counter()
    finally:
        hook.remove()
    return end - first["s"], out.shape[1] - ids.shape[1] - 1


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from modeling_dspark import DSparkDraftModel
    from modeling_dspark.target import apply_chat_template, load_target, shipped_drafter_for

    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    dtype = getattr(torch, args.dtype)
    target, tok = load_target(args.target, dtype=dtype)
    drafter = DSparkDraftModel.from_pretrained(str(shipped_drafter_for(args.target)), target=target, dtype=dtype)
    drafter.eval()
    prompts = [p for ps in load_domain_prompts(args.per_domain, 0).values() for p in ps]
    ids = [torch.tensor([apply_chat_template(tok, p["prompt"])]) for p in prompts]
    split_call(target, drafter, ids[0], 8)  # warm-up: kernels, and the prices' first rounds
    plain_step(target, ids[0], 8)
    totals, rounds, plain_s, plain_steps = dict.fromkeys(PARTS, 0.0), 0, 0.0, 0
    for i, x in enumerate(ids):  # interleaved: the order of the two alternates from prompt to prompt
        for arm in (("plain", "dspark") if i % 2 == 0 else ("dspark", "plain")):
            if arm == "plain":
                s, n = plain_step(target, x, args.max_new_tokens)
                plain_s, plain_steps = plain_s + s, plain_steps + n
            else:
                r = split_call(target, drafter, x, args.max_new_tokens)
                rounds += r["rounds"]
                for k, v in r["parts"].items():
                    totals[k] += v
    if not plain_steps or not rounds:
        raise SystemExit("no decoding step after a prefill was timed (every output ended at its first token)")
    step_ms = 1e3 * plain_s / plain_steps
    per_round = {k: 1e3 * v / rounds for k, v in totals.items()}
    result = result_header("bench_round_split", argv, threads)
    result.update({"target": args.target, "dtype": args.dtype,
                   "prompts": len(ids), "max_new_tokens": args.max_new_tokens, "rounds": rounds,
                   "plain_step_ms": step_ms, "per_round_ms": per_round,
                   "per_round_steps": {k: v / step_ms for k, v in per_round.items()}})
    lines = [f"Round split, {args.target} {args.dtype}, {threads} thread(s), {result['machine']['cpu']}: a plain step "
             f"{step_ms:.1f} ms; {rounds} rounds", "", "| part | ms per round | plain steps |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.2f} | {v / step_ms:.3f} |" for k, v in per_round.items()]
    lines.append(f"| **round** | {sum(per_round.values()):.2f} | {sum(per_round.values()) / step_ms:.3f} |")
    write_result(result, "\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
