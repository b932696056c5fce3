"""Sampling losslessness: with the drafter, the distribution of the first new tokens equals the target's.

On a tiny random Llama (V = 16) the exact joint distribution of the first three new tokens (x1 from the prefill,
x2 and x3 drafted in one block) under the processed target distribution (temperature, top-k / top-p) is
enumerated. N samples from `generate(assistant_model=drafter)` must match it cell by cell within 4.5 standard
errors plus 2/N (bound from the sample count N; with ≈ 600 cells the union-bound false-alarm rate is < 1 %, and
the seed is fixed). As a control for the enumeration itself, plain `generate()` sampling is checked against the
exact table of every processing used here with the same bound: N independent samples drawn in one batched call of
N copies of the prompt (the drafter's path is batch size 1).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import modeling_dspark as md
from generation import collect_stats, dspark_options

from .conftest import tiny_target

N = 3000
PROMPT = torch.tensor([[3, 7, 1, 12, 5]])


def _warpers(temperature, top_k, top_p):
    w = [TemperatureLogitsWarper(temperature)]
    if top_k:
        w.append(TopKLogitsWarper(top_k))
    if top_p:
        w.append(TopPLogitsWarper(top_p))
    return LogitsProcessorList(w)


@torch.no_grad()
def exact_joint(target, temperature, top_k, top_p) -> torch.Tensor:
    """P(x1, x2, x3 | prompt) under the processed target distribution, shape [V, V, V] float64."""
    v = target.config.vocab_size
    proc = _warpers(temperature, top_k, top_p)

    def next_probs(seqs):
        logits = target(seqs).logits[:, -1].float()
        return torch.softmax(proc(seqs, logits), dim=-1).double()

    p1 = next_probs(PROMPT)[0]  # [V]
    s1 = torch.cat([PROMPT.repeat(v, 1), torch.arange(v)[:, None]], dim=1)
    p2 = next_probs(s1)  # [V, V]
    s2 = torch.cat([s1.repeat_interleave(v, 0), torch.arange(v).repeat(v)[:, None]], dim=1)
    p3 = next_probs(s2).view(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


def _frequencies(new_tokens: torch.LongTensor, v: int) -> torch.Tensor:
    """Empirical joint of the first three new tokens: ``[n, ≥ 3]`` ids → ``[V, V, V]`` float64 frequencies."""
    x = new_tokens[:, :3]
    cells = (x[:, 0] * v + x[:, 1]) * v + x[:, 2]
    return (torch.bincount(cells, minlength=v**3).double() / len(cells)).view(v, v, v)


def _sample_counts(target, drafter, seed, policy=None, sps=None, draft_gate=True, **gen):
    """N calls of `generate(assistant_model=drafter)` (batch size 1) → (joint frequencies, their statistics)."""
    torch.manual_seed(seed)
    firsts = []
    with dspark_options(block_size=4, policy=policy, sps=sps, draft_gate=draft_gate), collect_stats() as runs:
        for _ in range(N):
            out = target.generate(
                PROMPT, max_new_tokens=4, do_sample=True, assistant_model=drafter, pad_token_id=0, **gen
            )
            firsts.append(out[0, PROMPT.shape[1] : PROMPT.shape[1] + 3])
    return _frequencies(torch.stack(firsts), target.config.vocab_size), runs


def _plain_counts(target, seed, **gen):
    """N samples of plain `generate()`: one call on N copies of the prompt, whose rows are sampled independently."""
    torch.manual_seed(seed)
    out = target.generate(PROMPT.repeat(N, 1), max_new_tokens=4, do_sample=True, pad_token_id=0, **gen)
    return _frequencies(out[:, PROMPT.shape[1] :], target.config.vocab_size)


def _assert_matches(emp, exact, label):
    for name, dims in (("x1", (1, 2)), ("x2", (0, 2)), ("x3", (0, 1)), ("x1,x2", (2,)), ("x2,x3", (0,))):
        p, q = exact.sum(dim=dims), emp.sum(dim=dims)
        bound = 4.5 * torch.sqrt(p * (1 - p) / N) + 2.0 / N
        worst = ((q - p).abs() - bound).max().item()
        assert worst <= 0, f"{label}: marginal {name} deviates beyond the sampling bound by {worst:.4f}"


def _tiny_drafter(target, seed, spread_confidence=False, **kw):
    torch.manual_seed(seed)
    cfg = md.DSparkConfig.from_target_config(target.config, block_size=4, markov_rank=8, target_layer_ids=[0, 2], **kw)
    drafter = md.DSparkDraftModel(cfg).eval().bind_target(target)
    with torch.no_grad():  # a non-zero correction, so eq. 4's sequential path is exercised
        drafter.sequential_head.out.weight.normal_(std=1.0)
        if spread_confidence:  # c_k spread around 0.4, so the scheduler's ℓ varies from round to round
            drafter.confidence_head.proj.weight.normal_(std=0.1)
            drafter.confidence_head.proj.bias.zero_()
        if drafter.draft_vocab_ids is not None:  # a draft vocabulary: q = 0 outside it, p_t is not
            drafter.draft_vocab_ids.copy_(torch.randperm(target.config.vocab_size)[: kw["draft_vocab_size"]])
    return drafter


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread avoids oversubscription overhead (≈ 15x faster here)
    target = tiny_target(vocab_size=16)
    drafters = {
        "markov": _tiny_drafter(target, 1, spread_confidence=True),
        "markov+draft_vocab": _tiny_drafter(target, 2, draft_vocab_size=10),
        "rnn+draft_vocab": _tiny_drafter(target, 3, sequential_head="rnn", draft_vocab_size=12),
    }
    yield target, drafters
    torch.set_num_threads(threads)


# the logits processing of every test here (temperature, top-k, top-p)
GENS = [{"temperature": 0.7, "top_k": 6}, {"temperature": 1.5, "top_p": 0.9}, {"temperature": 1.0},
        {"temperature": 0.9, "top_k": 8}]


def _generate_kwargs(gen):
    """`generate()` sampling options of ``gen``, the processors it leaves out turned off."""
    return {"top_k": gen.get("top_k", 0), "top_p": gen.get("top_p", 1.0), "temperature": gen["temperature"]}


@pytest.mark.parametrize(
    "gen,drafter_name,policy",
    [
        (GENS[0], "markov", None),
        (GENS[1], "markov+draft_vocab", None),
        (GENS[2], "rnn+draft_vocab", None),
        # confidence-scheduled truncation (Algorithm 1, R = 1) under sampling: still the target's distribution
        (GENS[3], "markov", "scheduler"),
    ],
)
def test_sampling_distribution_equals_target(tiny, gen, drafter_name, policy):
    target, drafters = tiny
    drafter = drafters[drafter_name]
    sps = {1: 1.0, 2: 0.75, 3: 0.6, 4: 0.5, 5: 0.4} if policy == "scheduler" else None
    exact = exact_joint(target, gen.get("temperature", 1.0), gen.get("top_k"), gen.get("top_p"))
    assert math.isclose(exact.sum().item(), 1.0, rel_tol=1e-6)
    kw = _generate_kwargs(gen)
    # the draft gate off: over N calls it would learn to skip most drafting here (its own test is below)
    emp, runs = _sample_counts(target, drafter, seed=1234, policy=policy, sps=sps, draft_gate=False, **kw)
    # the drafter's rounds (rounds that verified the lookup chain count its tokens; tests/test_lookup_generate.py)
    rounds = [r for s in runs for r in s.rounds if r.source != "lookup"]
    accepted = sum(r.accepted for r in rounds)
    rejected = sum(r.drafted - r.accepted for r in rounds)
    # both branches of rejection sampling were exercised
    assert accepted > 50 and rejected > 50, (accepted, rejected)
    if policy == "scheduler":  # the scheduler really cut some rounds short (ℓ < budget) and verified others
        lengths = [r.verified for r in rounds]
        assert min(lengths) < max(lengths), lengths[:20]
    _assert_matches(emp, exact, f"dspark {gen}")


@pytest.mark.parametrize("gen", GENS)
def test_plain_sampling_matches_enumeration(tiny, gen):
    """Control: plain generate() samples match the same exact table (validates the enumeration)."""
    target, _ = tiny
    exact = exact_joint(target, gen["temperature"], gen.get("top_k"), gen.get("top_p"))
    emp = _plain_counts(target, seed=99, **_generate_kwargs(gen))
    _assert_matches(emp, exact, f"plain generate {gen}")


def test_sampling_with_skipped_rounds_equals_target(tiny, monkeypatch):
    """The cost model's draft gate (generation/cost_model.py) skips drafting by past rounds only; here a coin
    flip independent of everything drawn stands in for it, so the first rounds both draft and skip (a skipped
    round is one plain target step whose features the drafter ingests at its next drafting round). The first
    new tokens still follow the target's distribution."""
    import random

    from generation.cost_model import CostModel

    coin = random.Random(0)

    def plan(self, budgets, skipped, context_len=None):
        return (list(budgets), "probe") if coin.random() < 0.5 else ([0] * len(budgets), "gated")

    monkeypatch.setattr(CostModel, "plan", plan)
    target, drafters = tiny
    sps = {1: 1.0, 2: 0.75, 3: 0.6, 4: 0.5, 5: 0.4}
    gen = GENS[3]
    exact = exact_joint(target, gen["temperature"], gen["top_k"], None)
    emp, runs = _sample_counts(target, drafters["markov"], seed=4321, policy="scheduler", sps=sps, **gen)
    firsts = [s.rounds[0] for s in runs]
    assert sum(r.gate == "gated" for r in firsts) > 0.4 * N and sum(r.gate == "probe" for r in firsts) > 0.4 * N
    rounds = [r for s in runs for r in s.rounds]
    assert sum(r.accepted for r in rounds) > 50 and sum(r.verified - r.accepted for r in rounds) > 50
    _assert_matches(emp, exact, "dspark scheduler with skipped rounds")
