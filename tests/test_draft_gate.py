"""generate()'s draft gate (R = 1, generation/draft_gate.py): its decisions on synthetic rounds, and through
generate() on a tiny and on the real target: skipped rounds run no drafter forward, their features reach the
drafter's context at the next drafting round, and greedy output stays identical to plain generate()."""

from __future__ import annotations

import pytest
import torch

from generation import collect_stats, dspark_options
from generation.draft_gate import SKIP_REASONS, DraftGate
from tests.conftest import make_drafter, tiny_target

STEEP = {1: 100.0, **{b: 25.0 for b in range(2, 18)}}  # a verify of 2+ tokens costs 4 one-token steps
FLAT = {b: 100.0 / (1 + 0.02 * (b - 1)) for b in range(1, 18)}  # drafting nearly free to verify


def _run(gate, n, verified, accepted, draft_s=0.005, round_s=(0.05, 0.01), committed=None, t=0.0):
    """Drive ``gate`` for ``n`` rounds on a simulated clock; a drafting round lasts round_s[0] and commits
    ``committed`` (default accepted + 1) tokens, a skipped one lasts round_s[1] and commits 1. Returns reasons."""
    reasons = []
    for _ in range(n):
        drafts, reason = gate.decide(8, now=t)
        reasons.append(reason)
        assert drafts == (reason not in SKIP_REASONS)
        if drafts:
            gate.record_draft(draft_s, verified=verified, accepted=accepted)
            gate.record_committed(accepted + 1 if committed is None else committed)
            t += round_s[0]
        else:
            gate.record_committed(1)
            t += round_s[1]
    return reasons, t


def test_warmup_then_gated_with_backoff_probes():
    """Steep SPS and a yield of 0 accepted per 2 verified: after the warm-up the gate skips drafting, re-probing
    with a doubling interval (each probe two drafting rounds) up to PROBE_MAX_INTERVAL."""
    gate = DraftGate(STEEP, veto=False)
    reasons, _ = _run(gate, 200, verified=2, accepted=0)
    assert reasons[: DraftGate.WARMUP_ROUNDS] == ["warmup"] * DraftGate.WARMUP_ROUNDS
    rest = reasons[DraftGate.WARMUP_ROUNDS :]
    assert set(rest) == {"gated", "probe"}
    starts = [i for i, r in enumerate(rest) if r == "probe" and (i == 0 or rest[i - 1] != "probe")]
    assert all(rest[i + 1] == "probe" for i in starts[:-1])  # a probe drafts PROBE_ROUNDS = 2 rounds in a row
    runs = "".join("g" if r == "gated" else "p" for r in rest).split("p")
    runs = [len(x) for x in runs if x][:-1]  # consecutive skipped rounds before each probe
    assert runs[:6] == [1, 2, 4, 8, 16, 32] and set(runs[6:]) == {DraftGate.PROBE_MAX_INTERVAL}
    assert sum(r == "probe" for r in rest) < 0.2 * len(rest)


def test_good_yield_drafts_every_round():
    gate = DraftGate(FLAT, veto=False)
    reasons, _ = _run(gate, 50, verified=4, accepted=3)
    assert reasons[DraftGate.WARMUP_ROUNDS :] == ["model"] * (50 - DraftGate.WARMUP_ROUNDS)


def test_budget_below_the_mean_yield():
    """Near the end of a call the budget (draft tokens left) falls below the mean accepted: still a decision."""
    gate = DraftGate(FLAT, veto=False)
    _run(gate, 10, verified=4, accepted=4)
    for budget in (1, 2, 3):
        assert gate.decide(budget) == (True, "model")


def test_gate_follows_the_yield_both_ways():
    """Where verifying costs a step (SPS(1) = 100, SPS(B > 1) = 60) drafting pays for a high yield only: the gate
    closes a few drafted rounds after the yield drops and reopens at a probe once it is back."""
    sps = {1: 100.0, **{b: 60.0 for b in range(2, 18)}}
    gate = DraftGate(sps, veto=False)
    first, t = _run(gate, 20, verified=4, accepted=3)
    assert first[-1] == "model"
    second, t = _run(gate, 40, verified=4, accepted=0, t=t)
    # the mean accepted decays by YIELD_DECAY per drafted round from 3 to below the break-even 1.17
    # ((1 + a) / (1/60 + 0.005 s) > 100): 5 rounds in exact arithmetic, a few more while the
    # sums still remember the warm-up
    assert second.index("gated") <= 8 and second[-1] in ("gated", "probe")
    third, _ = _run(gate, 80, verified=4, accepted=3, t=t)
    assert third[-1] == "model" and "probe" in third[: third.index("model")]


def test_veto_when_measured_drafting_rounds_are_slower():
    """The model says drafting pays (flat SPS, 3 of 4 accepted), but the measured drafting rounds commit 4 tokens
    in 0.2 s (20 tokens/s) against 1 token in 0.01 s (100 tokens/s) without: the gate pairs windows with
    non-drafting rounds, then vetoes drafting and re-probes it with the back-off."""
    gate = DraftGate(FLAT, veto=True)
    reasons, _ = _run(gate, 600, verified=4, accepted=3, round_s=(0.2, 0.01))
    assert "pair" in reasons and "veto" in reasons
    after = reasons[reasons.index("veto") :]
    assert sum(r not in SKIP_REASONS for r in after) < 0.2 * len(after)
    assert gate.rates.ratio(1) < 0.5
    # the same rounds without the veto: drafted throughout
    plain, _ = _run(DraftGate(FLAT, veto=False), 600, verified=4, accepted=3, round_s=(0.2, 0.01))
    assert set(plain[DraftGate.WARMUP_ROUNDS :]) == {"model"}


@pytest.fixture(scope="module")
def tiny(one_thread):
    target = tiny_target(vocab_size=32, seed=3)
    return target, make_drafter(target, block_size=4, seed=1)


def _generate(target, drafter, ids, sps, max_new=60, **opts):
    calls = []
    hook = drafter.register_forward_hook(lambda *a: calls.append(1))
    try:
        with dspark_options(policy="scheduler", sps=sps, **opts), collect_stats() as runs:
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new, do_sample=False)
    finally:
        hook.remove()
    return out, runs[-1], len(calls)


def _check_context(stats, prompt_len):
    """At every drafting round the drafter's context holds every committed position before the anchor: the
    positions ingested so far sum to L − 1 (L = the round's committed length, prompt + prefill token + rounds)."""
    length, ingested = prompt_len + 1, 0
    for r in stats.rounds:
        ingested += r.ingested
        if r.gate not in SKIP_REASONS:
            assert ingested == length - 1, (ingested, length)
        else:
            assert r.ingested == 0 and r.drafted == 0 and r.verified == 0
        length += r.committed


def test_generate_skips_drafting_yet_identical(tiny):
    """A random drafter (nothing accepted) under the steep table: most rounds skip the drafter, the rest are the
    warm-up and probes; the output equals plain greedy generate()."""
    target, drafter = tiny
    ids = torch.tensor([[3, 5, 7, 1, 9]])
    ref = target.generate(ids, max_new_tokens=60, do_sample=False)
    out, stats, calls = _generate(target, drafter, ids, STEEP)
    assert torch.equal(out, ref)
    skipped = [r for r in stats.rounds if r.gate in SKIP_REASONS]
    assert len(skipped) >= 0.6 * len(stats.rounds)
    assert calls == len(stats.rounds) - len(skipped)  # a skipped round runs no drafter forward
    assert stats.summary()["skipped_draft_rounds"] == len(skipped)
    _check_context(stats, ids.shape[1])
    # without the gate: every round drafts, same output
    out2, stats2, calls2 = _generate(target, drafter, ids, STEEP, draft_gate=False)
    assert torch.equal(out2, ref) and calls2 == len(stats2.rounds)
    assert all(r.gate == "" for r in stats2.rounds)


@pytest.mark.parametrize("max_new", [38, 39, 40])
def test_oracle_drafts_to_the_end(tiny, monkeypatch, max_new):
    """Drafts that are always right with confidence 0.99 under a flat table: the gate keeps drafting, also in the
    last rounds where the budget is below γ' (and below the mean accepted), and the output is plain greedy."""
    target, drafter = tiny
    ids = torch.tensor([[3, 5, 7, 1, 9]])
    ref = target.generate(ids, max_new_tokens=max_new, do_sample=False)

    def oracle(self, input_ids, hidden, base_logits, budget):
        self.policy.start_round(budget)
        n = 0
        while n < budget and self.policy.admit(n + 1, 0.99):
            n += 1
        cur = input_ids.shape[1]
        return ref[:, cur : cur + n], None, [0.99] * n

    from generation.candidate_generator import DSparkCandidateGenerator

    monkeypatch.setattr(DSparkCandidateGenerator, "propose", oracle)
    out, stats, _ = _generate(target, drafter, ids, FLAT, max_new=max_new)
    assert torch.equal(out, ref)
    assert all(r.gate in ("warmup", "model", "pair") for r in stats.rounds)
    assert sum(r.gate == "model" for r in stats.rounds) >= 3 and stats.tau > 3
    # the last round: a budget of 1-3 < γ' = 4, below the mean accepted, decided by the model
    last = stats.rounds[-1]
    assert last.gate == "model" and last.verified == (max_new - 2) % 5 < 4


def test_learned_state_carries_over_to_the_next_call(tiny):
    """A second call with the same drafter, target, block size and table starts from a copy of the first call's
    gate: no warm-up, the probe back-off where it was; the first call's gate is not touched by the second; another
    table starts afresh."""
    target, drafter = tiny
    ids = torch.tensor([[4, 2, 8, 6]])
    table = {b: v * 0.9 for b, v in STEEP.items()}  # a table no other test uses
    _, first, _ = _generate(target, drafter, ids, table, max_new=40)
    assert first.rounds[0].gate == "warmup"
    from generation.draft_gate import _LAST_GATES

    gates = _LAST_GATES[drafter][target]
    (key,) = [k for k in gates if k[2][0] == pytest.approx(90.0)]
    before = gates[key]
    snapshot = (before.drafted_rounds, list(before.yield_sums), before.interval)
    _, second, _ = _generate(target, drafter, ids, table, max_new=40)
    assert all(r.gate != "warmup" for r in second.rounds)
    assert (before.drafted_rounds, before.yield_sums, before.interval) == snapshot
    assert gates[key] is not before and gates[key].drafted_rounds >= before.drafted_rounds
    _, third, _ = _generate(target, drafter, ids, {b: v * 0.8 for b, v in STEEP.items()}, max_new=40)
    assert third.rounds[0].gate == "warmup"


def test_prompt_catch_up_is_not_steady(tiny, monkeypatch):
    """A later call whose first round is skipped ingests the whole prompt at its first drafting round: that round's
    drafter time is not steady (it would teach the gate that drafting is slow); later one-round catch-ups are."""
    target, drafter = tiny
    ids = torch.tensor([list(range(1, 21))])
    _generate(target, drafter, ids, STEEP, max_new=30)  # learns: drafting does not pay under STEEP
    from generation.draft_gate import _LAST_GATES

    (stored,) = _LAST_GATES[drafter][target].values()
    stored.interval, stored.skipped = 1, 0  # as after a round the model let draft: the next call probes at round 2
    seen = []
    real = DraftGate.record_draft

    def spy(self, seconds, verified, accepted, steady=True):
        seen.append(steady)
        return real(self, seconds, verified, accepted, steady)

    monkeypatch.setattr(DraftGate, "record_draft", spy)
    _, stats, _ = _generate(target, drafter, ids, STEEP, max_new=60)
    drafting = [r for r in stats.rounds if r.gate not in SKIP_REASONS]
    assert stats.rounds[0].gate in SKIP_REASONS  # the carried-over gate skips the first round
    assert stats.rounds[1].gate == "probe" and drafting[0] is stats.rounds[1]  # one skipped round, then the prompt
    assert len(seen) == len(drafting) and drafting[0].ingested > ids.shape[1] and seen[0] is False


def test_other_policies_are_not_gated(tiny):
    target, drafter = tiny
    ids = torch.tensor([[3, 5, 7, 1, 9]])
    with dspark_options(policy="full"), collect_stats() as runs:
        target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False)
    assert all(r.gate == "" and r.drafted >= 1 for r in runs[-1].rounds[:-1])


def test_draft_gate_option_must_be_bool():
    with pytest.raises(ValueError, match="draft_gate must be True or False"):
        with dspark_options(policy="scheduler", draft_gate="no"):
            pass


def test_real_target_gated_rounds_greedy_identical(smollm, prompt_ids, random_drafter):
    """SmolLM2-135M (fp32) with an untrained drafter under the steep table: rounds skip the drafter and catch up
    later, and the output is identical to plain generate() token for token."""
    target, _ = smollm
    for ids in prompt_ids[:2]:
        ref = target.generate(ids, max_new_tokens=48, do_sample=False)
        with dspark_options(policy="scheduler", sps=STEEP, block_size=8), collect_stats() as runs:
            out = target.generate(ids, assistant_model=random_drafter, max_new_tokens=48, do_sample=False)
        assert torch.equal(out, ref)
        stats = runs[-1]
        assert any(r.gate in SKIP_REASONS for r in stats.rounds)
        assert any(r.gate == "probe" and r.ingested > r.committed for r in stats.rounds)  # catch-up
        _check_context(stats, ids.shape[1])
