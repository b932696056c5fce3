"""Power of the sampling tests: run their checks on samples drawn with a deliberately broken rule.

Each case is one of the sampling-distribution tests (tests/test_lossless_sampling.py, tests/test_lookup_generate.py):
the same tiny target, drafter, prompt, processing, seed and N. Each mutation breaks one part of lossless sampling:

- ``none``: the shipped code (the checks must pass);
- ``residual_from_p``: after a rejected draft the target token is drawn from p instead of the residual
  norm(max(0, p − q)) (the verify rule, transformers' ``_speculative_sampling``, patched);
- ``q_without_temperature``: the candidate logits handed to the verify lack the temperature (the drafts are still
  drawn from the processed q);
- ``peek``: the choice of chain looks at the drafted token: in a round that drafted, the drafted chain is verified
  (its first token) only where that token agrees with the lookup's first, else the lookup's first token is (the
  cut to one token alone is lossless; the case with the lookup proposer only).

For each (case, mutation) the script reports the smallest χ² p-value over the five marginals (the tests' check, with
probability-0 cells: fail below ``ALPHA``), the largest deviation of a cell over a per-cell bound of 4.5 standard
errors + 2/N (compared: fail above 1), and the rounds of the N calls by the chain they verified. One run per pair,
at the tests' seeds (a rerun draws the same sample). Each pair runs in its own process
(the mutations patch modules).

    python benchmarks/sampling_test_power.py --jobs 2 --out benchmarks/results/sampling-test-power.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CASES = ["gen0", "gen1", "gen2", "gen3", "lookup+skipped"]
MUTATIONS = ["none", "residual_from_p", "q_without_temperature", "peek"]


def temperature(case: str) -> float:
    """The sampling temperature of ``case`` (the tests' processing)."""
    from tests import test_lookup_generate as tlg
    from tests import test_lossless_sampling as tls

    return tlg.GEN["temperature"] if case == "lookup+skipped" else tls.DRAFTER_CASES[int(case[3])][0]["temperature"]


def applies(case: str, mutation: str) -> bool:
    """Whether ``mutation`` changes anything in ``case``: the temperature one needs T ≠ 1, ``peek`` the lookup."""
    if mutation == "q_without_temperature":
        return temperature(case) != 1.0
    if mutation == "peek":
        return case == "lookup+skipped"
    return True


def _mutate(mutation: str, case: str) -> None:
    """Install ``mutation`` (module doc) by patching the modules in this process."""
    import torch
    import transformers.generation.utils as tgu

    import dspark.generation.candidate_generator as cg
    from dspark.generation.round import Chain

    if mutation == "residual_from_p":
        def speculative_sampling(candidate_input_ids, candidate_logits, candidate_length, new_logits, **_):
            new = candidate_input_ids[:, -candidate_length:]
            q, p = candidate_logits.softmax(-1), new_logits.softmax(-1)
            pos = torch.arange(candidate_length)
            ratio = p[:, pos, new].squeeze(0, 1) / q[:, pos, new].squeeze(0, 1)
            matches = ((~(torch.rand_like(ratio) <= ratio)).cumsum(-1) < 1).sum()
            t = torch.multinomial(p[:, matches, :], 1).squeeze(1)[None, :]  # the bug: p, not the residual
            return (torch.cat((new[:, :matches], t), -1) if matches > 0 else t), matches

        tgu._speculative_sampling = speculative_sampling
    elif mutation == "q_without_temperature":
        get_candidates, t = cg.DSparkCandidateGenerator.get_candidates, temperature(case)

        def unscaled(self, *args, **kwargs):
            ids, logits = get_candidates(self, *args, **kwargs)
            return ids, None if logits is None else logits * t

        cg.DSparkCandidateGenerator.get_candidates = unscaled
    elif mutation == "peek":
        real_propose = cg.propose

        def propose(drafter, policy, states, committed, rooms, block_size, sampler=None):
            chains = real_propose(drafter, policy, states, committed, rooms, block_size, sampler)
            chain, lookup = chains[0], states[0].lookup
            match = lookup.propose(rooms[0]).tokens if lookup is not None else []
            if chain.source == "draft" and match and chain.tokens[:1] != match[:1]:
                chains[0] = Chain(match[:1], "lookup", draft_tokens=chain.draft_tokens, confidences=chain.confidences,
                                  ingested=chain.ingested, t_draft_ms=chain.t_draft_ms, plan=chain.plan)
            elif chain.source == "draft":
                chain.cut(1)
            return chains

        cg.propose = propose
    elif mutation != "none":
        raise ValueError(f"unknown mutation {mutation!r}")


def run_one(case: str, mutation: str, n: int) -> dict:
    """Draw the case's N samples under ``mutation`` and apply both checks (module doc)."""
    import torch

    from tests import test_lookup_generate as tlg
    from tests import test_lossless_sampling as tls

    torch.set_num_threads(1)
    tls.N = n
    _mutate(mutation, case)
    target, drafters = tls.tiny_models()
    if case == "lookup+skipped":  # tests/test_lookup_generate.py, the drafter + lookup + skipped rounds test
        tls.PROMPT = tlg.ALL_TOKENS_PROMPT
        tlg.install_coin_decisions(setattr)
        exact, counts, runs = tlg.sample_drafter_lookup_and_skipped(target, drafters["markov"])
    else:  # test_lossless_sampling.py::test_sampling_distribution_equals_target[genI-…]
        exact, counts, runs = tls.sample_drafter_case(target, drafters, *tls.DRAFTER_CASES[int(case[3])])
    fit = tls.fit(counts, exact)
    chi2_min_p = min(pvalue if impossible == 0 else 0.0 for _, impossible, pvalue in fit)
    per_cell = 0.0
    for _, dims in tls.MARGINALS:
        p, freq = exact.sum(dim=dims), counts.sum(dim=dims) / n
        per_cell = max(per_cell, ((freq - p).abs() / (4.5 * torch.sqrt(p * (1 - p) / n) + 2.0 / n)).max().item())
    rounds = [r for stats in runs for r in stats.rounds]
    return {"case": case, "mutation": mutation, "N": n, "chi2_min_p": chi2_min_p, "chi2_fails": chi2_min_p < tls.ALPHA,
            "per_cell_ratio": round(per_cell, 3), "per_cell_fails": per_cell > 1,
            "rounds": {"total": len(rounds), "draft_chain": sum(r.source == "draft" for r in rounds),
                       "lookup_chain": sum(r.source == "lookup" for r in rounds),
                       "anchor_only": sum(r.source == "" for r in rounds)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="samples per check (default: the tests' N, 3000)")
    ap.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    ap.add_argument("--mutations", nargs="+", default=MUTATIONS, choices=MUTATIONS)
    ap.add_argument("--jobs", type=int, default=1, help="pairs run at once, one process each (default: 1)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--one", nargs=2, metavar=("CASE", "MUTATION"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(*args.one, args.n)))
        return 0
    pairs = [(c, m) for c in args.cases for m in args.mutations if applies(c, m)]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def child(pair):
        out = subprocess.run([sys.executable, __file__, "--n", str(args.n), "--one", *pair], env=env, cwd=ROOT,
                             capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(row), flush=True)
        return row

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(pool.map(child, pairs))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "N": args.n, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
