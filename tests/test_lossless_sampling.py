"""Sampling losslessness: with the drafter, the distribution of the first new tokens equals the target's.

On a tiny random Llama (V = 16) the exact joint distribution of the first three new tokens (x1 from the prefill,
x2 and x3 drafted in one block) under the processed target distribution (temperature, top-k / top-p) is
enumerated. N samples from `generate(assistant_model=drafter)` must fit it: for each of five marginals (x1, x2, x3,
(x1, x2), (x2, x3)) no sample falls in a cell of probability 0, and Pearson's χ² goodness-of-fit test (cells pooled
to an expected count ≥ 5) gives a p-value ≥ ALPHA. With ALPHA = 1e-4 a correct sampler fails a given check (five
marginals) with a nominal probability (χ² approximation) < 5e-4, so < 1 % over this suite's 11 checks. The seeds are
fixed (no choice of the round reads a clock), so a failure can be replayed. As a control for the enumeration itself, plain `generate()` sampling is
checked against the exact table of every processing used here the same way: N independent samples drawn in one
batched call of N copies of the prompt (the drafter's path is batch size 1).

The χ² test pools the evidence of all cells, so it catches rules that shift probability a little in many cells: at
N = 3000, in one run at these seeds, it caught resampling a rejected draft from p instead of the residual
norm(max(0, p − q)) in every drafter test here, and candidate logits handed to the verify without the temperature at
T = 0.7, where a per-cell bound of 4.5 standard errors missed both in some tests (benchmarks/sampling_test_power.py;
docs/studies/2026-12-sampling-test-power.md).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import modeling_dspark as md
from dspark.generation import collect_stats, dspark_options

from .conftest import tiny_target

pytestmark = pytest.mark.core  # also run at both ends of the supported versions (scripts/test_versions.sh)

N = 3000
ALPHA = 1e-4  # the smallest p-value a check accepts, per marginal (module doc)
PROMPT = torch.tensor([[3, 7, 1, 12, 5]])
SCHEDULER_SPS = {1: 1.0, 2: 0.75, 3: 0.6, 4: 0.5, 5: 0.4}  # SPS(B), steps/s, for the scheduler's tests
MARGINALS = (("x1", (1, 2)), ("x2", (0, 2)), ("x3", (0, 1)), ("x1,x2", (2,)), ("x2,x3", (0,)))  # name, dims summed


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


def _counts(new_tokens: torch.LongTensor, v: int) -> torch.Tensor:
    """Empirical joint of the first three new tokens: ``[n, ≥ 3]`` ids → ``[V, V, V]`` float64 counts."""
    x = new_tokens[:, :3]
    cells = (x[:, 0] * v + x[:, 1]) * v + x[:, 2]
    return torch.bincount(cells, minlength=v**3).double().view(v, v, v)


def _sample_counts(target, drafter, seed, policy=None, sps=None, **gen):
    """N calls of `generate(assistant_model=drafter)` (batch size 1) → (joint counts, their statistics)."""
    torch.manual_seed(seed)
    firsts = []
    with dspark_options(block_size=4, policy=policy, sps=sps), collect_stats() as runs:
        for _ in range(N):
            out = target.generate(
                PROMPT, max_new_tokens=4, do_sample=True, assistant_model=drafter, pad_token_id=0, **gen
            )
            firsts.append(out[0, PROMPT.shape[1] : PROMPT.shape[1] + 3])
    return _counts(torch.stack(firsts), target.config.vocab_size), runs


def _plain_counts(target, seed, **gen):
    """N samples of plain `generate()`: one call on N copies of the prompt, whose rows are sampled independently."""
    torch.manual_seed(seed)
    out = target.generate(PROMPT.repeat(N, 1), max_new_tokens=4, do_sample=True, pad_token_id=0, **gen)
    return _counts(out[:, PROMPT.shape[1] :], target.config.vocab_size)


def _pooled(observed: np.ndarray, expected: np.ndarray, min_expected: float = 5.0):
    """``[C]`` observed and ``[C]`` expected counts → ``([B], [B])`` per bin, B ≤ C: the cells taken in order of
    expected count and merged into bins of expected count ≥ ``min_expected`` (the last bin absorbs a remainder), so
    that χ² applies. The bins depend on the expected counts only."""
    obs, exp, o, e = [], [], 0.0, 0.0
    for i in np.argsort(expected, kind="stable"):
        o, e = o + observed[i], e + expected[i]
        if e >= min_expected:
            obs, exp, o, e = obs + [o], exp + [e], 0.0, 0.0
    obs[-1], exp[-1] = obs[-1] + o, exp[-1] + e
    return np.array(obs), np.array(exp)


def fit(counts, exact) -> list[tuple[str, int, float]]:
    """``counts`` ([V, V, V] float64 counts of n samples) against ``exact`` ([V, V, V] probabilities), per marginal:
    (name, samples in cells of probability 0, χ² p-value over the other cells, pooled by :func:`_pooled`)."""
    n = counts.sum().item()
    out = []
    for name, dims in MARGINALS:
        p, c = exact.sum(dim=dims).flatten().numpy(), counts.sum(dim=dims).flatten().numpy()
        possible = p > 0
        obs, exp = _pooled(c[possible], p[possible] * n)
        pvalue = chisquare(obs, exp * (obs.sum() / exp.sum())).pvalue  # equal totals (the table sums to 1 ± rounding)
        out.append((name, int(c[~possible].sum()), float(pvalue)))
    return out


def _assert_matches(counts, exact, label):
    """Per marginal, no sample where the probability is 0 and the χ² p-value ≥ ALPHA (:func:`fit`, module doc)."""
    for name, impossible, pvalue in fit(counts, exact):
        assert impossible == 0, f"{label}: {impossible} samples of {name} have probability 0"
        assert pvalue >= ALPHA, f"{label}: marginal {name} does not fit the target's (χ² p = {pvalue:.1e})"


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


def tiny_models():
    """The tiny target (V = 16) and the three drafters of these tests, by name."""
    target = tiny_target(vocab_size=16)
    return target, {
        "markov": _tiny_drafter(target, 1, spread_confidence=True),
        "markov+draft_vocab": _tiny_drafter(target, 2, draft_vocab_size=10),
        "rnn+draft_vocab": _tiny_drafter(target, 3, sequential_head="rnn", draft_vocab_size=12),
    }


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread avoids oversubscription overhead (≈ 15x faster here)
    yield tiny_models()
    torch.set_num_threads(threads)


# the logits processing of every test here (temperature, top-k, top-p)
GENS = [{"temperature": 0.7, "top_k": 6}, {"temperature": 1.5, "top_p": 0.9}, {"temperature": 1.0},
        {"temperature": 0.9, "top_k": 8}]


def _generate_kwargs(gen):
    """`generate()` sampling options of ``gen``, the processors it leaves out turned off."""
    return {"top_k": gen.get("top_k", 0), "top_p": gen.get("top_p", 1.0), "temperature": gen["temperature"]}


# (processing, drafter, policy) of test_sampling_distribution_equals_target
DRAFTER_CASES = [  # full: every round drafts, so both branches of rejection sampling run often
    (GENS[0], "markov", "full"),
    (GENS[1], "markov+draft_vocab", "full"),
    (GENS[2], "rnn+draft_vocab", "full"),
    # confidence-scheduled truncation (Algorithm 1, R = 1) under sampling: still the target's distribution
    (GENS[3], "markov", "scheduler"),
]


def sample_drafter_case(target, drafters, gen, drafter_name, policy):
    """One case of DRAFTER_CASES: (exact joint, sample counts, run statistics)."""
    exact = exact_joint(target, gen.get("temperature", 1.0), gen.get("top_k"), gen.get("top_p"))
    counts, runs = _sample_counts(target, drafters[drafter_name], seed=1234, policy=policy,
                                  sps=SCHEDULER_SPS if policy == "scheduler" else None, **_generate_kwargs(gen))
    return exact, counts, runs


@pytest.mark.parametrize("gen,drafter_name,policy", DRAFTER_CASES)
def test_sampling_distribution_equals_target(tiny, gen, drafter_name, policy):
    target, drafters = tiny
    exact, counts, runs = sample_drafter_case(target, drafters, gen, drafter_name, policy)
    assert math.isclose(exact.sum().item(), 1.0, rel_tol=1e-6)
    # the drafter's rounds (rounds that verified the lookup chain count its tokens; tests/test_lookup_generate.py)
    rounds = [r for s in runs for r in s.rounds if r.source != "lookup"]
    accepted = sum(r.accepted for r in rounds)
    rejected = sum(r.drafted - r.accepted for r in rounds)
    # both branches of rejection sampling were exercised
    assert accepted > 50 and rejected > 50, (accepted, rejected)
    if policy == "scheduler":  # the scheduler really cut some rounds short (ℓ < budget) and verified others
        lengths = [r.verified for r in rounds]
        assert min(lengths) < max(lengths), lengths[:20]
    _assert_matches(counts, exact, f"dspark {gen}")


@pytest.mark.parametrize("gen", GENS)
def test_plain_sampling_matches_enumeration(tiny, gen):
    """Control: plain generate() samples match the same exact table (validates the enumeration)."""
    target, _ = tiny
    exact = exact_joint(target, gen["temperature"], gen.get("top_k"), gen.get("top_p"))
    counts = _plain_counts(target, seed=99, **_generate_kwargs(gen))
    _assert_matches(counts, exact, f"plain generate {gen}")
