"""Benchmark: milliseconds of one drafting round (`dspark.generation.drafting.draft_round`), R = 1, on real target
features.

The shipped drafter of the target drafts γ' slots after ingesting 2 new positions of a prompt the target prefilled
(a steady round), ``--rounds`` times per policy (``full``, and ``scheduler`` with every slot worth verifying so that
it drafts the same slots and asks the policy at every slot); the median per round is reported. ``--checkout DIR`` runs another checkout's
`generation` package (e.g. ``git worktree add --detach /tmp/base <commit>``) on the same job, so two commits are
compared on one machine: run the two commands back to back, or alternate them.

    python benchmarks/bench_draft_round.py --out /tmp/draft-new.json
    python benchmarks/bench_draft_round.py --checkout /tmp/base --out /tmp/draft-base.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--checkout", default=None, help="the checkout whose generation package is timed (default: this)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))  # the models, prompts and drafters of this checkout
    import torch

    from dspark.evaluation.profiling import cpu_model
    from modeling_dspark import DSparkDraftModel
    from dspark.generation.features import context_features, hidden_state_indices
    from modeling_dspark.target import apply_chat_template, load_target
    from modeling_dspark.target import shipped_drafter_for

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, tok = load_target(args.target, dtype=dtype)
    drafter = DSparkDraftModel.from_pretrained(str(shipped_drafter_for(args.target)), target=target, dtype=dtype)
    drafter.eval()
    package = "dspark.generation"
    if args.checkout:  # time the other checkout's round on the same models
        root = Path(args.checkout).resolve()
        if not (root / "dspark" / "__init__.py").is_file():  # a checkout from before the `dspark` namespace
            package = "generation"
        top = package.split(".")[0]
        for name in [m for m in sys.modules if m == top or m.startswith(f"{top}.")]:
            del sys.modules[name]
        sys.path.insert(0, str(root))
    generation = importlib.import_module(package)
    drafting, policies = (importlib.import_module(f"{package}.{m}") for m in ("drafting", "policies"))
    RequestState = importlib.import_module(f"{package}.round").RequestState

    ids = torch.tensor([apply_chat_template(tok, "Write a Python function that checks whether a number is prime.")])
    layers = list(drafter.config.target_layer_ids)
    with torch.no_grad():
        out = target(ids, output_hidden_states=hidden_state_indices(layers))
    feats = context_features(out.hidden_states, layers, 0, ids.shape[1] - 1)
    kv_cls = getattr(drafting, "RequestKV")
    gamma = drafter.config.block_size
    sps = {b: 100.0 for b in range(1, 2 * gamma + 4)}  # flat: every slot is worth verifying
    result = {"processor": cpu_model(), "checkout": str(Path(generation.__file__).parent.parent), "target": args.target,
              "dtype": args.dtype, "threads": args.threads, "block_size": gamma, "rounds": args.rounds, "ms": {}}
    for spec in ("full", "scheduler"):
        policy = policies.parse_policy(spec).start(sps)
        times = []
        ctx = drafting.DraftContext(kv_cls(drafter.config.num_draft_layers), [feats[:, :-2]])
        prompt_len = ids.shape[1] - 1
        for i in range(args.rounds + 11):  # round 0 ingests the prompt; later rounds, 2 new positions each (steady)
            if i:
                ctx.cache.length = prompt_len - 2
                ctx.pending = [feats[:, -2:]]
            plan = policy.plan([RequestState(None, None)], [gamma], [[]], ids.shape[1])
            t0 = time.perf_counter()
            if isinstance(plan, tuple):  # a checkout from before RoundPlan: plan() gave (lookup lengths, budgets)
                res = drafting.draft_round(drafter, [ctx], [int(ids[0, -1])], [ids.shape[1] - 1], plan[1], policy,
                                           num_slots=gamma)
            else:
                res = drafting.draft_round(drafter, [ctx], [int(ids[0, -1])], [ids.shape[1] - 1], plan, policy,
                                           block_size=gamma)
            if i > 10:
                times.append(time.perf_counter() - t0)
        assert res.lengths == [gamma], res.lengths
        result["ms"][spec] = round(1e3 * statistics.median(times), 3)
    print(json.dumps(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
