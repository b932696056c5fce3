"""Estimate: would verifying the lookup continuation and the drafter's block together, as a small tree, pay?

`generate(assistant_model=drafter)` verifies ONE chain per round, a prefix of the n-gram lookup continuation or of
the drafter's block (:func:`generation.scheduler.choose_chain`). A tree verifier (both chains in one target
forward, a 4-D attention mask, the losing branch dropped from the KV cache) would commit the longer accepted chain
every round at the price of a larger verify batch. This script estimates that trade from recorded proposals; it
does not implement a tree verifier.

Per held-out prompt (math: GSM8K, code: HumanEval, chat: MT-Bench / AlpacaEval first turns), greedy, float32:

1. plain `generate()` gives the reference continuation (timed, with a one-token call for the prefill);
2. `generate(assistant_model=drafter)` with the lookup proposer on, ``dspark_options(policy="scheduler",
   draft_gate=False)`` and the drafter forced to run every round (``LookupChain.before_drafting`` patched in this
   script) is recorded round by round: start length, lookup proposal, the drafter's tokens and confidences, the
   chain chosen (``RoundStats.source``); its output must equal the reference;
3. offline, at EVERY position of the reference, the lookup proposal (``NGramLookup``, as `generate()` builds it) and
   the drafter's full block with its confidences (``draft_round`` with policy ``full`` on the target features of one
   forward over prompt + reference). The recorded rounds check these offline proposals.

Each strategy is then simulated as its own walk along the reference: from position t a round verifies B tokens,
commits 1 + (accepted length, the longest common prefix of its chain with the reference at t) and costs
1/SPS(B) + t_draft when the drafter ran (greedy commits the reference whatever the chain, so acceptance depends on
the strategy only through the position). Strategies: plain; lookup only (the whole proposal); transformers' prompt
lookup (``prompt_lookup_num_tokens=10``, n-grams of length ≤ 2, the whole proposal every round; the most recent match
is copied where transformers copies the earliest); drafter only (full
block, and the scheduler's prefix); the chooser (the library's rule, drafter forced as recorded, and the library's
rule that may skip the drafter); the recorded run itself; an oracle chooser (per round the best of: anchor only,
the lookup proposal or the chooser's prefix of it, the scheduler's draft prefix, knowing what is accepted); and the
tree: both chains in one verify, B = 1 + L_lookup + L_draft − (their common prefix), committed 1 + max of the two
acceptances — with full chains, with each cut to the chooser's prefix, and "priced" (the tree of the cut chains
only in rounds where its expected rate beats the chooser's choice).

SPS(B) curves: (a) this machine's cached profile (``generation.profiling``, ``$DSPARK_PROFILE_DIR``), (b) the AMX
Xeon bf16 R = 1 curve of ``benchmarks/results/serve/serve.json`` (B = 1, 2, 3, 5, 9; step time extrapolated
linearly from B = 5..9 to B = 17), (b') the same with the steeper per-token slope of its R = 2 row (a
sensitivity check). The drafter's time per round is a fixed fraction of a plain step, from quiet runs in
docs/benchmarks.md: 10.7 / 52.5 ms on the EPYC in fp32 (`generate-avx2.json`), 5.8 / 37.4 ms on the Xeon in bf16;
the same for the scheduler's early-stopped block and a full block (a full block costs somewhat more: its sequential
head runs all γ slots). The ratio measured in this run is reported beside it. Speeds exclude the prefill (decode
rounds only); a tree verify is priced as a chain of the same B tokens (no mask or cache-compaction overhead).

    python benchmarks/estimate_tree.py --per-domain 2 --max-new-tokens 96 \
        --threads 2
    python benchmarks/estimate_tree.py --per-domain 1 --max-new-tokens 24 --threads 2 --out /tmp/tree.json

Writes JSON to ``--out`` (default ``benchmarks/results/tree-estimate.json``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

STRATEGIES = {
    "plain": "plain decoding (B = 1)",
    "lookup": "lookup only (whole proposal)",
    "prompt_lookup": "prompt lookup as transformers' defaults (K = 10, n ≤ 2)",
    "draft_full": "drafter only (full block)",
    "draft_prefix": "drafter only (scheduler's prefix)",
    "recorded": "chooser, recorded run (drafter forced)",
    "chooser": "chooser, simulated (drafter forced)",
    "chooser_skip": "chooser, simulated (may skip the drafter)",
    "oracle": "oracle chooser",
    "tree_full": "tree: full lookup + full block",
    "tree_cut": "tree: chooser's prefixes of both",
    "tree_priced": "tree of the prefixes when it prices higher, else chooser",
}
PROMPT_LOOKUP = (10, 2)
"""transformers' prompt lookup defaults as the issue measured it: (prompt_lookup_num_tokens, max_matching_ngram_size)."""
SINGLE_CHAIN = ("lookup", "prompt_lookup", "draft_full", "draft_prefix", "chooser", "chooser_skip")
"""Realizable one-chain strategies (the recorded run is `chooser` priced for this machine's curve)."""
TREES = ("tree_full", "tree_cut", "tree_priced")
XEON_DRAFT_RATIO = 5.8 / 37.4
"""The Xeon's drafting time per round over its plain bf16 step (docs/benchmarks.md, 5.8 ms vs 37.4 ms)."""
EPYC_DRAFT_RATIO = 10.7 / 52.5
"""The EPYC's drafting time per round over its plain fp32 step (docs/benchmarks.md, `generate-avx2.json`)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", default="drafters/smollm2-135m-dspark", help="drafter directory")
    p.add_argument("--target", default=None, help="target directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--per-domain", type=int, default=3, help="prompts per domain (default: 3)")
    p.add_argument("--offset", type=int, default=0, help="skip the first N prompts of each eval set (default: 0)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per prompt (default: 96)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all usable cores)")
    p.add_argument("--serve-json", default=str(REPO_ROOT / "benchmarks" / "results" / "serve" / "serve.json"),
                   help="JSON whose sps_profile holds the Xeon bf16 SPS(B) curve (default: the committed serve run)")
    p.add_argument("--xeon-draft-ratio", type=float, default=XEON_DRAFT_RATIO,
                   help="drafting time per round / plain step on the Xeon (default: 5.8 / 37.4)")
    p.add_argument("--epyc-draft-ratio", type=float, default=EPYC_DRAFT_RATIO,
                   help="drafting time per round / plain step for this machine's curve (default: 10.7 / 52.5, a "
                        "quiet EPYC fp32 run; 0 = the ratio measured in this run)")
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "tree-estimate.json"))
    return p.parse_args(argv)


def lcp(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ------------------------------------------------------------------------------------------ SPS(B) curves
def xeon_curves(serve_json: str, max_batch: int) -> dict:
    """The Xeon's R = 1 bf16 curve extrapolated to ``max_batch`` two ways: step time linear in B with the slope of its
    last two R = 1 points (``xeon_bf16``), and with the slope per token of its R = 2 row (``xeon_bf16_steep``)."""
    from generation.profiling import SPSCurve

    prof = json.loads(Path(serve_json).read_text())["sps_profile"]
    ctx = min(prof, key=int)
    r1 = {int(b): float(s) for b, s in prof[ctx]["1"].items()}
    r2 = {int(b): float(s) for b, s in prof[ctx]["2"].items()}
    bs = sorted(r1)
    b0, b1 = bs[-2], bs[-1]
    slopes = {"xeon_bf16": (1 / r1[b1] - 1 / r1[b0]) / (b1 - b0)}
    q = sorted(r2)
    slopes["xeon_bf16_steep"] = (1 / r2[q[-1]] - 1 / r2[q[-2]]) / (q[-1] - q[-2])
    out = {}
    for name, slope in slopes.items():
        points = dict(r1)
        for b in range(b1 + 1, max_batch + 1):
            points[b] = 1.0 / (1 / r1[b1] + slope * (b - b1))
        out[name] = {"curve": SPSCurve(points, f"Xeon bf16 R=1 context {ctx}, {name}"), "measured": r1,
                     "extrapolation_ms_per_token": slope * 1e3}
    return out


# ------------------------------------------------------------------------------------------ the recorded run
@contextlib.contextmanager
def recording(log: list):
    """Patch (for this script only) `generate()`'s candidate generator so that every round is appended to ``log``,
    and force the drafter to run every round (``LookupChain.before_drafting`` always answers "draft")."""
    import generation.candidate_generator as cg
    from generation.lookup import LookupChain
    from generation.scheduler import ChainChoice

    orig_get, orig_draft, orig_before = cg.DSparkCandidateGenerator.get_candidates, cg.draft_round, \
        LookupChain.before_drafting
    last: dict = {}

    def draft_round(*args, **kwargs):
        out = orig_draft(*args, **kwargs)
        last["out"] = out
        return out

    def get_candidates(self, input_ids, *args, **kwargs):
        n_rounds = len(self.stats.rounds)
        last.clear()
        result = orig_get(self, input_ids, *args, **kwargs)
        if len(self.stats.rounds) > n_rounds:
            out = last.get("out")
            log.append({"start": int(input_ids.shape[1]),
                        "lookup": list(self.lookup.proposal.tokens) if self.lookup is not None else [],
                        "draft": [int(x) for x in out.tokens[0]] if out is not None else [],
                        "confidences": [float(c) for c in out.confidences[0]] if out is not None else [],
                        "stats": self.stats.rounds[-1]})
        return result

    def before_drafting(self, budget, sps, draft_seconds, gate=""):
        return ChainChoice("draft", budget, 0.0, 1.0)

    cg.DSparkCandidateGenerator.get_candidates, cg.draft_round = get_candidates, draft_round
    LookupChain.before_drafting = before_drafting
    try:
        yield log
    finally:
        cg.DSparkCandidateGenerator.get_candidates, cg.draft_round = orig_get, orig_draft
        LookupChain.before_drafting = orig_before


def run_prompt(target, drafter, ids, gen: dict) -> dict:
    """Reference, timings and the recorded assisted run of one prompt (``ids``: ``[1, P]``)."""
    import torch

    from generation import collect_stats, dspark_options

    mask = torch.ones_like(ids)
    with torch.inference_mode():
        t0 = time.perf_counter()
        target.generate(ids, attention_mask=mask, **dict(gen, max_new_tokens=1))
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = target.generate(ids, attention_mask=mask, **gen)[0, ids.shape[1]:].tolist()
        t_plain = time.perf_counter() - t0
        log: list = []
        with recording(log), collect_stats(), dspark_options(policy="scheduler", draft_gate=False, lookup=True):
            t0 = time.perf_counter()
            out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **gen)[0, ids.shape[1]:]
            t_assisted = time.perf_counter() - t0
    rounds = []
    for r in log:
        s = r.pop("stats")
        rounds.append(dict(r, source=s.source, verified=s.verified, accepted=s.accepted, committed=s.committed,
                           drafted=s.drafted, ingested=s.ingested, t_draft_ms=s.t_draft_ms, t_verify_ms=s.t_verify_ms))
    return {"reference": ref, "identical": out.tolist() == ref, "seconds_prefill": t_prefill,
            "seconds_plain": t_plain, "seconds_assisted": t_assisted, "rounds": rounds}


# ------------------------------------------------------------------------------------------ offline proposals
def proposals(target, drafter, prompt_ids: list[int], ref: list[int], max_new: int) -> dict:
    """At every position t = 1..N−1 of the reference (t generated tokens committed): the lookup proposal and the
    drafter's full block (policy ``full``) with its confidences, as `generate()` would build them there; the
    drafter's time per call (ms, position 1 excluded: it ingests the whole prompt)."""
    import torch

    from generation.drafting import DraftContext, draft_round
    from generation.lookup import LookupChain, NGramLookup
    from generation.packed_target import RequestKV
    from generation.policies import parse_policy
    from modeling_dspark.target import context_features

    gamma = drafter.config.block_size
    layer_ids = list(drafter.config.target_layer_ids)
    seq = prompt_ids + ref
    p, n = len(prompt_ids), len(ref)
    template = LookupChain(num_positions=max(16, gamma)).matcher
    matcher = NGramLookup(max_ngram=template.max_ngram, num_tokens=template.num_tokens)
    full = parse_policy("full")
    with torch.inference_mode():
        hidden = target(input_ids=torch.tensor([seq], device=target.device), output_hidden_states=True).hidden_states
        feats = context_features(hidden, layer_ids)  # [1, P + N, m·H]
        ctx = DraftContext(RequestKV(drafter.config.num_draft_layers))
        lookup, draft, conf, ms = {}, {}, {}, []
        taken = 0
        for t in range(1, n):
            length = p + t
            room = max_new - t - 1
            matcher.update(seq[:length])
            lookup[t] = matcher.propose(min(room, gamma)).tokens if room > 0 else []
            ctx.pending.append(feats[:, taken : length - 1])
            taken = length - 1
            budget = min(gamma, room)
            if budget <= 0:
                draft[t], conf[t] = [], []
                continue
            t0 = time.perf_counter()
            out = draft_round(drafter, [ctx], [seq[length - 1]], [length - 1], [budget], full, num_slots=gamma)
            if t > 1:
                ms.append((time.perf_counter() - t0) * 1e3)
            draft[t] = [int(x) for x in out.tokens[0][:budget]]
            conf[t] = [float(c) for c in out.confidences[0][:budget]]
    return {"lookup": lookup, "draft": draft, "confidences": conf, "draft_full_ms": ms}


# ------------------------------------------------------------------------------------------ simulated walks
def tree_expected(a_lookup, a_draft, shared: int) -> float:
    """Expected tokens a tree of two chains commits: 1 + Σ_k P(depth k accepted). Up to their common prefix the two
    chains are one path (the larger estimate); past it their tokens differ at the branch point, and under greedy at
    most one branch matches the target's argmax, so the events are disjoint (the sum, capped at 1)."""
    total = 1.0
    for k in range(max(len(a_lookup), len(a_draft))):
        x = a_lookup[k] if k < len(a_lookup) else 0.0
        y = a_draft[k] if k < len(a_draft) else 0.0
        total += max(x, y) if k < shared else min(1.0, x + y)
    return total


def simulate(strategy: str, d: dict, sps, t_draft: dict, gamma: int) -> dict:
    """Walk ``strategy`` along one prompt's reference; tokens, seconds, rounds, Σ B and the chains chosen.

    ``d``: ``prompt`` (ids), ``ref``, ``max_new``, ``lookup`` / ``draft`` / ``confidences`` per position t.
    ``t_draft``: the drafter's time per round in seconds, ``{"prefix": …, "full": …}`` (the scheduler's
    early-stopped block, and all γ slots).
    """
    from generation.lookup import LookupChain, NGramLookup
    from generation.policies import parse_policy, verify_lengths
    from generation.scheduler import best_prefix, effective_sps, survival_row

    sched = parse_policy("scheduler")
    chain = LookupChain(num_positions=max(16, gamma))  # the lookup's acceptance estimate along this walk
    td = t_draft["full"] if strategy in ("draft_full", "tree_full") else t_draft["prefix"]
    eff = effective_sps(sps, t_draft["prefix"])
    seq, p, ref, n = d["prompt"] + d["ref"], len(d["prompt"]), d["ref"], len(d["ref"])
    pld = NGramLookup(max_ngram=PROMPT_LOOKUP[1], num_tokens=PROMPT_LOOKUP[0])
    t, seconds, rounds, batch, picks = 1, 0.0, 0, 0, Counter()
    while t < n:
        room = d["max_new"] - t - 1
        lt, dt, dc = d["lookup"][t], d["draft"][t], d["confidences"][t]
        if strategy == "prompt_lookup":
            pld.update(seq[: p + t])
            lt = pld.propose(room).tokens if room > 0 else []
        al, ad = lcp(lt, ref[t:]), lcp(dt, ref[t:])
        budget = len(dt)
        ell_d = verify_lengths(sched, [dc], [budget], eff)[0] if budget else 0
        runs = budget > 0 and any(verify_lengths(sched, [[1.0] * budget], [budget], eff))
        if room > 0:
            prop = chain.propose(seq[: p + t], min(room, gamma))
            if prop.tokens != lt and strategy != "prompt_lookup":
                raise RuntimeError(f"lookup proposal at t={t} differs from the offline one")
        accepted, b, drafted, source, verified_draft = 0, 1, False, "none", []
        if strategy in ("lookup", "prompt_lookup") and lt:
            accepted, b, source = al, 1 + len(lt), "lookup"
        elif strategy == "draft_full" and budget:
            accepted, b, drafted, source, verified_draft = ad, 1 + budget, True, "draft", dt
        elif strategy == "draft_prefix" and runs:
            accepted, b, drafted, source, verified_draft = min(ad, ell_d), 1 + ell_d, True, "draft", dt[:ell_d]
        elif strategy in ("chooser", "chooser_skip", "tree_priced") and budget:
            skip = strategy == "chooser_skip" and lt and \
                chain.before_drafting(budget, sps, t_draft["prefix"]).source == "lookup"
            if skip:
                choice = chain.without_drafter(sps)
                ell = choice.length if choice.source == "lookup" else 0
                accepted, b, source = min(al, ell), 1 + ell, "lookup" if ell else "none"
            else:
                ell_run = ell_d if runs else 0
                accepted, b, drafted, source, verified_draft = min(ad, ell_run), 1 + ell_run, runs, "draft", \
                    dt[:ell_run]
                theta = None
                if lt:
                    choice = chain.after_drafting(dc[: ell_run + 1] if runs else [], ell_run, budget, sps,
                                                  t_draft["prefix"], greedy=True)
                    theta = choice.theta
                    if choice.source == "lookup":
                        accepted, b, source, verified_draft = min(al, choice.length), 1 + choice.length, "lookup", []
                if strategy == "tree_priced" and lt and runs and ell_d:
                    ell_l = best_prefix(chain.survival, sps, t_draft["prefix"])[0]
                    shared = lcp(lt[:ell_l], dt[:ell_d])
                    b_tree = 1 + ell_l + ell_d - shared
                    exp = tree_expected(chain.survival[:ell_l], survival_row(dc[:ell_d]), shared)
                    if ell_l and exp / (t_draft["prefix"] + 1.0 / sps(b_tree)) > theta:
                        accepted = max(min(al, ell_l), min(ad, ell_d))
                        b, drafted, source, verified_draft = b_tree, True, "tree", dt[:ell_d]
        elif strategy == "oracle":
            options = [(0, 1, False, "none", [])]
            if lt:
                options.append((al, 1 + len(lt), False, "lookup", []))
                ell_l = best_prefix(chain.survival, sps, 0.0)[0]
                if ell_l:
                    options.append((min(al, ell_l), 1 + ell_l, False, "lookup", []))
            if runs:
                options.append((min(ad, ell_d), 1 + ell_d, True, "draft", dt[:ell_d]))
            accepted, b, drafted, source, verified_draft = max(
                options, key=lambda o: min(1 + o[0], n - t) / (1.0 / sps(o[1]) + (td if o[2] else 0.0)))
        elif strategy == "tree_full" and budget:
            accepted, b = max(al, ad), 1 + len(lt) + budget - lcp(lt, dt)
            drafted, source, verified_draft = True, "tree" if lt else "draft", dt
        elif strategy == "tree_cut" and budget:
            ell_l = best_prefix(chain.survival, sps, t_draft["prefix"])[0] if lt else 0
            ell_run = ell_d if runs else 0
            accepted = max(min(al, ell_l), min(ad, ell_run))
            b = 1 + ell_l + ell_run - lcp(lt[:ell_l], dt[:ell_run])
            drafted, verified_draft = runs, dt[:ell_run]
            source = "tree" if ell_l and ell_run else "lookup" if ell_l else "draft" if ell_run else "none"
        k = min(1 + accepted, n - t)
        seconds += 1.0 / sps(b) + (td if drafted else 0.0)
        rounds, batch = rounds + 1, batch + b
        picks[source] += 1
        if room > 0:
            chain.verifying("draft" if verified_draft else "lookup" if source == "lookup" else "none",
                            verified_draft)
            chain.observe(seq[: p + t + k])
        t += k
    return {"tokens": n - 1, "seconds": seconds, "rounds": rounds, "batch_tokens": batch, "picks": dict(picks)}


def recorded_walk(rec: dict, sps, t_draft: dict) -> dict:
    """The recorded run priced with ``sps``: each round 1/SPS(1 + verified) (+ t_draft where the drafter ran); the
    tokens no round committed (the last, when no room was left to draft) as plain steps."""
    n = len(rec["reference"])
    seconds, batch, committed = 0.0, 0, 0
    for r in rec["rounds"]:
        seconds += 1.0 / sps(1 + r["verified"]) + (t_draft["prefix"] if r["ingested"] > 0 else 0.0)
        batch += 1 + r["verified"]
        committed += r["committed"]
    plain = max(0, n - 1 - committed)
    seconds += plain / sps(1)
    picks = Counter(r["source"] or "none" for r in rec["rounds"])
    picks["none"] += plain
    return {"tokens": n - 1, "seconds": seconds, "rounds": len(rec["rounds"]) + plain, "batch_tokens": batch + plain,
            "picks": dict(picks)}


# ------------------------------------------------------------------------------------------ summaries
def summarise(walks: list[dict], domains: list[str]) -> dict:
    """Per domain and strategy: tokens/s, × plain, τ (tokens per round), mean B; macro = mean of domain ratios."""
    out: dict = {"domains": {}, "macro": {}}
    for dom in domains:
        per = {}
        for s in STRATEGIES:
            ws = [w[s] for w in walks if w["domain"] == dom]
            tok, sec = sum(w["tokens"] for w in ws), sum(w["seconds"] for w in ws)
            rounds, batch = sum(w["rounds"] for w in ws), sum(w["batch_tokens"] for w in ws)
            picks = Counter()
            for w in ws:
                picks.update(w["picks"])
            per[s] = {"tokens": tok, "seconds": sec, "tokens_per_s": tok / sec, "tau": tok / rounds,
                      "mean_batch": batch / rounds, "picks": dict(picks)}
        for s in per:
            per[s]["vs_plain"] = per[s]["tokens_per_s"] / per["plain"]["tokens_per_s"]
        out["domains"][dom] = per
    for s in STRATEGIES:
        doms = [out["domains"][dom][s] for dom in domains]
        out["macro"][s] = {"vs_plain": sum(x["vs_plain"] for x in doms) / len(doms),
                           "tau": sum(x["tokens"] for x in doms) / sum(x["tokens"] / x["tau"] for x in doms),
                           "mean_batch": sum(x["mean_batch"] * x["tokens"] / x["tau"] for x in doms)
                           / sum(x["tokens"] / x["tau"] for x in doms)}
    best = max(SINGLE_CHAIN, key=lambda s: out["macro"][s]["vs_plain"])
    out["best_single_chain"] = best
    out["trees_vs_best_single_chain"] = {s: out["macro"][s]["vs_plain"] / out["macro"][best]["vs_plain"]
                                         for s in TREES}
    out["trees_vs_oracle"] = {s: out["macro"][s]["vs_plain"] / out["macro"]["oracle"]["vs_plain"] for s in TREES}
    out["chooser_vs_prompt_lookup"] = {dom: out["domains"][dom]["chooser_skip"]["vs_plain"]
                                       / out["domains"][dom]["prompt_lookup"]["vs_plain"] for dom in domains}
    out["chooser_vs_prompt_lookup"]["macro"] = out["macro"]["chooser_skip"]["vs_plain"] \
        / out["macro"]["prompt_lookup"]["vs_plain"]
    return out


def markdown(result: dict) -> str:
    m, st = result["machine"], result["settings"]
    lines = [f"CPU here: {m['cpu']}, torch threads {m['torch_threads']}; {st['per_domain']} prompts per domain × "
             f"{st['max_new_tokens']} new tokens, greedy float32. Recorded runs identical to plain: "
             f"{result['checks']['identical']}/{result['checks']['prompts']}; offline lookup proposals equal to "
             f"the recorded ones in {result['checks']['lookup_equal']}/{result['checks']['lookup_rounds']} rounds, "
             f"offline drafts in {result['checks']['draft_equal']}/{result['checks']['draft_rounds']}.", ""]
    for name, c in result["curves"].items():
        lines.append(f"- `{name}`: {c['description']}; t_draft {c['t_draft_ms']['prefix']:.1f} ms per round; "
                     f"1/SPS(1) = {c['step_ms'][1]:.1f} ms, "
                     f"1/SPS(9) = {c['step_ms'][9]:.1f} ms, 1/SPS(17) = {c['step_ms'][17]:.1f} ms.")
    lines += ["", "Estimated speed-up over plain decoding (decode rounds only):", "",
              "| SPS(B) curve | strategy | math | code | chat | macro | τ | mean B |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, c in result["curves"].items():
        s = c["summary"]
        for k, label in STRATEGIES.items():
            doms = " | ".join(f"{s['domains'][d][k]['vs_plain']:.2f}×" for d in s["domains"])
            mac = s["macro"][k]
            lines.append(f"| {name} | {label} | {doms} | {mac['vs_plain']:.2f}× | {mac['tau']:.2f} | "
                         f"{mac['mean_batch']:.1f} |")
    lines.append("")
    for name, c in result["curves"].items():
        s = c["summary"]
        lines.append(f"- `{name}`: best single chain `{s['best_single_chain']}` "
                     f"({s['macro'][s['best_single_chain']]['vs_plain']:.2f}×); trees vs it: " + ", ".join(
                         f"{k} {v:.2f}×" for k, v in s["trees_vs_best_single_chain"].items())
                     + "; vs the oracle chooser: " + ", ".join(
                         f"{k} {v:.2f}×" for k, v in s["trees_vs_oracle"].items())
                     + "; the chooser (may skip) over prompt lookup: " + ", ".join(
                         f"{k} {v:.2f}×" for k, v in s["chooser_vs_prompt_lookup"].items()) + ".")
    meas = result["measured_here"]
    est = result["curves"]["epyc_fp32"]["summary"]
    load = (m.get("load_average_at_start") or [float("nan")])[0]
    lines.append(f"- measured here in the same run (load average {load:.1f} at the start; prefill included): "
                 f"plain step {meas['plain_step_ms']:.1f} ms, "
                 f"drafting {meas['draft_ms_scheduler_block']:.1f} ms per round (full block "
                 f"{meas['draft_ms_full_block_offline']:.1f} ms); the recorded assisted run "
                 + ", ".join(f"{d} {v:.2f}×" for d, v in meas["recorded_vs_plain"].items())
                 + f", macro {meas['recorded_vs_plain_macro']:.2f}× plain; its estimate on `epyc_fp32`: "
                 + ", ".join(f"{d} {est['domains'][d]['recorded']['vs_plain']:.2f}×" for d in est["domains"])
                 + f", macro {est['macro']['recorded']['vs_plain']:.2f}×.")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not Path(args.drafter).is_dir():
        sys.exit(f"drafter directory not found: {args.drafter}")
    if not Path(args.serve_json).is_file():
        sys.exit(f"--serve-json not found: {args.serve_json}")
    if args.per_domain < 1 or args.max_new_tokens < 8:
        sys.exit("--per-domain must be >= 1 and --max-new-tokens >= 8 (drafting rounds time the drafter)")
    for name in ("xeon_draft_ratio", "epyc_draft_ratio"):
        if not 0.0 <= getattr(args, name) < 10.0:
            sys.exit(f"--{name.replace('_', '-')} must be in [0, 10); got {getattr(args, name)}")
    import torch
    from transformers.utils import logging as hf_logging

    from benchmarks.bench_generate import result_header, usable_cores, write_result
    from benchmarks.bench_proposers import DOMAINS, load_domain_prompts
    from dspark_cli.common import load_models
    from generation.profiling import DEFAULT_CONTEXTS, ensure_profile
    from modeling_dspark.target import DEFAULT_TARGET, apply_chat_template

    hf_logging.disable_progress_bar()
    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    target, tok, drafter = load_models(args.target, args.drafter, "float32")
    gamma = drafter.config.block_size
    max_batch = 1 + 2 * gamma
    profile = ensure_profile(target, requests=(1,), tokens=tuple(range(1, max_batch + 1)), threads=threads)
    epyc = profile.curve(1, DEFAULT_CONTEXTS[0])  # the quick profile's context; it reaches B = 2γ + 1
    if epyc.max_batch < max_batch:
        sys.exit(f"this machine's SPS profile ends at B = {epyc.max_batch}; the tree needs B = {max_batch}")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    gen = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": pad}
    prompts = load_domain_prompts(args.per_domain, args.offset)
    encoded = [(dom, pr, apply_chat_template(tok, pr["prompt"])) for dom, ps in prompts.items() for pr in ps]
    run_prompt(target, drafter, torch.tensor([encoded[0][2]]), dict(gen, max_new_tokens=8))  # one-time costs

    records = []
    for dom, pr, ids in encoded:
        rec = run_prompt(target, drafter, torch.tensor([ids]), gen)
        rec.update(domain=dom, id=pr["id"], prompt_tokens=len(ids))
        prop = proposals(target, drafter, ids, rec["reference"], args.max_new_tokens)
        rec["offline"] = prop
        records.append(rec)
        print(f"[tree] {dom} {pr['id']}: {len(rec['reference'])} tokens, {len(rec['rounds'])} rounds, identical "
              f"{rec['identical']}", file=sys.stderr, flush=True)

    # checks of the offline proposals against the recorded rounds
    checks = Counter(prompts=len(records), identical=sum(r["identical"] for r in records))
    for rec in records:
        for r in rec["rounds"]:
            t = r["start"] - rec["prompt_tokens"]
            if t not in rec["offline"]["lookup"]:
                continue
            if r["lookup"]:
                checks["lookup_rounds"] += 1
                checks["lookup_equal"] += r["lookup"] == rec["offline"]["lookup"][t]
            if r["draft"]:
                checks["draft_rounds"] += 1
                checks["draft_equal"] += r["draft"] == rec["offline"]["draft"][t][: len(r["draft"])]

    # the drafter's time, as a fraction of a plain step measured here
    steady = [r["t_draft_ms"] for rec in records for r in rec["rounds"] if 0 < r["ingested"] <= gamma + 1]
    step_ms = statistics.median((rec["seconds_plain"] - rec["seconds_prefill"]) * 1e3 / (len(rec["reference"]) - 1)
                                for rec in records if len(rec["reference"]) > 1)
    if not steady:
        sys.exit("no steady drafting round was recorded to time the drafter: raise --max-new-tokens")
    draft_ms = statistics.median(steady)
    full_ms = statistics.median(x for rec in records for x in rec["offline"]["draft_full_ms"])
    epyc_ratio = args.epyc_draft_ratio or draft_ms / step_ms
    curves = {"epyc_fp32": {"curve": epyc, "ratio": {"prefix": epyc_ratio, "full": epyc_ratio},
                            "description": f"this machine's profile ({epyc.description})"}}
    for name, x in xeon_curves(args.serve_json, max_batch).items():
        curves[name] = {"curve": x["curve"],
                        "ratio": {"prefix": args.xeon_draft_ratio, "full": args.xeon_draft_ratio},
                        "description": f"AMX Xeon bf16, R = 1, measured B = {sorted(x['measured'])}, step time "
                                       f"extrapolated beyond at {x['extrapolation_ms_per_token']:.3f} ms per token"}

    domains = [dom for dom in DOMAINS if any(r["domain"] == dom for r in records)]
    result_curves = {}
    for name, c in curves.items():
        sps = c["curve"]
        t_draft = {k: v / sps(1) for k, v in c["ratio"].items()}
        walks = []
        for (_, _, ids), rec in zip(encoded, records):
            if len(rec["reference"]) < 2:
                continue
            d = {"prompt": ids, "ref": rec["reference"], "max_new": args.max_new_tokens,
                 **{k: rec["offline"][k] for k in ("lookup", "draft", "confidences")}}
            w = {"domain": rec["domain"], "id": rec["id"]}
            for s in STRATEGIES:
                w[s] = recorded_walk(rec, sps, t_draft) if s == "recorded" else simulate(s, d, sps, t_draft, gamma)
            walks.append(w)
        result_curves[name] = {"description": c["description"], "draft_over_step": c["ratio"],
                               "t_draft_ms": {k: v * 1e3 for k, v in t_draft.items()},
                               "step_ms": {b: 1e3 / sps(b) for b in range(1, max_batch + 1)},
                               "summary": summarise(walks, domains), "per_prompt": walks}

    measured = {dom: sum(r["seconds_plain"] for r in records if r["domain"] == dom)
                / sum(r["seconds_assisted"] for r in records if r["domain"] == dom) for dom in domains}
    result = {
        **result_header("tree-estimate", argv, threads),
        "target": args.target or DEFAULT_TARGET,
        "drafter": args.drafter,
        "settings": {"per_domain": args.per_domain, "offset": args.offset, "max_new_tokens": args.max_new_tokens,
                     "dtype": "float32", "greedy": True, "block_size": gamma, "policy": "scheduler",
                     "draft_gate": False, "drafter_forced": True, "prefill_counted": False,
                     "xeon_draft_ratio": args.xeon_draft_ratio, "epyc_draft_ratio": epyc_ratio,
                     "strategies": STRATEGIES,
                     "prompt_ids": {dom: [p["id"] for p in ps] for dom, ps in prompts.items()}},
        "checks": dict(checks),
        "measured_here": {"plain_step_ms": step_ms, "draft_over_step": draft_ms / step_ms,
                          "draft_ms_scheduler_block": draft_ms,
                          "draft_ms_full_block_offline": full_ms,
                          "recorded_vs_plain": measured,
                          "recorded_vs_plain_macro": sum(measured.values()) / len(measured)},
        "curves": result_curves,
        "per_prompt": [{k: v for k, v in r.items() if k != "offline"} for r in records],
    }
    for k in ("lookup_rounds", "lookup_equal", "draft_rounds", "draft_equal"):
        result["checks"].setdefault(k, 0)
    write_result(result, markdown(result), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
