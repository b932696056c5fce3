"""Greedy losslessness on the real SmolLM2 target (fp32): output identical to plain generate(), token for token."""

from __future__ import annotations

import math

import pytest
import torch

from dspark.generation import collect_stats, dspark_options

pytestmark = pytest.mark.core  # also run at both ends of the supported versions (scripts/test_versions.sh)

BLOCK_SIZES = [1, 2, 4, 8, 16]
MAX_NEW = [1, 7, 64]


@pytest.fixture(scope="module")
def references(smollm, prompt_ids):
    target, _ = smollm
    return {
        (i, n): target.generate(ids, max_new_tokens=n, do_sample=False)
        for i, ids in enumerate(prompt_ids)
        for n in MAX_NEW
    }


def _check(target, drafter, prompt_ids, references, block_size, max_new):
    for i, ids in enumerate(prompt_ids):
        with dspark_options(block_size=block_size), collect_stats() as runs:
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new, do_sample=False)
        ref = references[(i, max_new)]
        assert out.shape[1] - ids.shape[1] <= max_new
        assert torch.equal(out, ref), f"prompt {i}, block {block_size}, max_new {max_new}: outputs differ"
        yield runs[-1]


# Which (max_new, block size) cases run 64 tokens. After the prefill, 7 new tokens leave room for 5 drafts, so at 7
# tokens blocks of 1, 2 and 4 can be verified full but blocks of 8 and 16 cannot. The oracle (every draft accepted)
# runs 64 tokens at every block size, the adversarial script (every draft rejected, asserted) at 8 and 16, where
# only 64 tokens verify full blocks (the 7-token cases reject full blocks of 1, 2 and 4). The random drafter (on a
# 49k vocabulary almost never accepted) adds the real drafting path, which the scripts replace (conftest.scripted):
# 64 tokens at block size 16 here and at 8 in test_other_heads_and_draft_vocab_greedy_identical. (Each 64-token
# case costs about 45 s of a 2-core CPU.)
RANDOM_CASES = [(n, b) for n in MAX_NEW for b in BLOCK_SIZES if n < 64 or b == 16]
ADVERSARIAL_CASES = [(n, b) for n in MAX_NEW for b in BLOCK_SIZES if n < 64 or b in (8, 16)]


@pytest.mark.parametrize(("max_new", "block_size"), RANDOM_CASES)
def test_random_drafter_greedy_identical(smollm, prompt_ids, references, random_drafter, block_size, max_new):
    target, _ = smollm
    for stats in _check(target, random_drafter, prompt_ids, references, block_size, max_new):
        assert all(r.drafted <= block_size for r in stats.rounds)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("max_new", MAX_NEW)
def test_oracle_drafter_accepts_every_block(
    smollm, prompt_ids, references, random_drafter, scripted, block_size, max_new
):
    target, _ = smollm
    for i, ids in enumerate(prompt_ids):
        scripted(references[(i, 64)], "oracle", target.config.vocab_size)
        counter = {"n": 0}
        hook = target.register_forward_hook(lambda *a: counter.__setitem__("n", counter["n"] + 1))
        try:
            # policy full: every round drafts (the default prices rounds and may take plain steps)
            with dspark_options(block_size=block_size, policy="full"), collect_stats() as runs:
                out = target.generate(ids, assistant_model=random_drafter, max_new_tokens=max_new, do_sample=False)
        finally:
            hook.remove()
        ref = references[(i, max_new)]
        assert torch.equal(out, ref)
        n_new = out.shape[1] - ids.shape[1]
        # work per round is bounded: N tokens take at most 1 + ceil((N-1)/(k+1)) target forwards
        assert counter["n"] <= 1 + math.ceil((n_new - 1) / (block_size + 1)), (counter, n_new, block_size)
        stats = runs[-1]
        # every round but possibly the last (cut by length / EOS) accepts everything it drafted
        assert all(r.accepted == r.drafted for r in stats.rounds[:-1])


@pytest.mark.parametrize(("max_new", "block_size"), ADVERSARIAL_CASES)
def test_adversarial_drafter_rejected_yet_identical(
    smollm, prompt_ids, references, random_drafter, scripted, block_size, max_new
):
    target, _ = smollm
    for i, ids in enumerate(prompt_ids):
        scripted(references[(i, 64)], "adversarial", target.config.vocab_size)
        with dspark_options(block_size=block_size), collect_stats() as runs:
            out = target.generate(ids, assistant_model=random_drafter, max_new_tokens=max_new, do_sample=False)
        assert torch.equal(out, references[(i, max_new)])
        assert all(r.accepted == 0 for r in runs[-1].rounds)
        assert all(r.committed == 1 for r in runs[-1].rounds)


def test_drafter_input_does_not_grow_with_prefix(smollm, prompt_ids, random_drafter):
    """The drafter reads only the newly committed positions each round (≤ γ'+1 rows), never the whole prefix (the
    lookup proposer off: a round it wins skips the drafter, whose next round then ingests two rounds' positions)."""
    target, _ = smollm
    rows = []
    hook = random_drafter.register_forward_hook(
        lambda mod, args, kwargs, out: rows.append(args[2].shape[1]), with_kwargs=True
    )
    try:
        with dspark_options(block_size=4, lookup=False, policy="full"):  # full: every round drafts
            target.generate(prompt_ids[0], assistant_model=random_drafter, max_new_tokens=40, do_sample=False)
    finally:
        hook.remove()
    assert rows[0] == prompt_ids[0].shape[1]  # first round ingests the prompt
    assert len(rows) > 5 and max(rows[1:]) <= 4 + 1


def test_eos_inside_accepted_block(smollm, random_drafter, scripted):
    """EOS inside a block the oracle drafted: generation stops exactly where plain generate() stops."""
    from modeling_dspark.target import apply_chat_template

    target, tok = smollm
    ids = torch.tensor([apply_chat_template(tok, "Say hello.")])
    ref = target.generate(ids, max_new_tokens=64, do_sample=False)
    assert ref[0, -1].item() == tok.eos_token_id and ref.shape[1] - ids.shape[1] < 64, "prompt must end with EOS"
    scripted(ref, "oracle", target.config.vocab_size)  # proposes 0s after EOS too
    for k in (3, 8, 16):
        with dspark_options(block_size=k), collect_stats() as runs:
            out = target.generate(ids, assistant_model=random_drafter, max_new_tokens=64, do_sample=False)
        assert torch.equal(out, ref)
        assert runs[-1].rounds[-1].committed <= k + 1


@pytest.mark.parametrize(
    "kwargs",
    [
        # min_new_tokens 30 holds back the EOS that ends the first prompt's answer after 25 tokens under this penalty
        {"repetition_penalty": 1.3, "min_new_tokens": 30},
        {"repetition_penalty": 1.2, "no_repeat_ngram_size": 2, "min_new_tokens": 10},
    ],
)
def test_logits_processors_greedy_identical(smollm, prompt_ids, references, random_drafter, scripted, kwargs):
    """The random drafter (its drafts almost always rejected), then the oracle script (its drafts accepted), on every
    prompt: the script replaces the drafting round for the rest of the test, so the drafter runs on all prompts
    first."""
    target, _ = smollm
    which = [0, 1, 2, len(prompt_ids) - 1]
    prompts = [prompt_ids[i] for i in which]
    refs = [target.generate(ids, max_new_tokens=40, do_sample=False, **kwargs) for ids in prompts]
    # the processors change some prompt's greedy output (plain greedy: a prefix of the 64-token reference)
    assert any(not torch.equal(ref, references[(i, 64)][:, : ref.shape[1]]) for i, ref in zip(which, refs)), kwargs
    for ids, ref in zip(prompts, refs):
        with dspark_options(block_size=8):
            out = target.generate(ids, assistant_model=random_drafter, max_new_tokens=40, do_sample=False, **kwargs)
        assert torch.equal(out, ref), kwargs
    for ids, ref in zip(prompts, refs):
        scripted(ref, "oracle", target.config.vocab_size)
        with dspark_options(block_size=8):
            out = target.generate(ids, assistant_model=random_drafter, max_new_tokens=40, do_sample=False, **kwargs)
        assert torch.equal(out, ref), kwargs


def test_other_assistants_unchanged(smollm, prompt_ids):
    """The DSpark hook leaves transformers' own assisted decoding (prompt lookup) working."""
    target, _ = smollm
    ids = prompt_ids[0]
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=20, do_sample=False)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("head", ["rnn", "none"])
def test_other_heads_and_draft_vocab_greedy_identical(smollm, prompt_ids, references, head):
    """RNN head / plain DFlash ("none"), with a reduced draft vocabulary: still identical."""
    from .conftest import make_drafter

    target, _ = smollm
    drafter = make_drafter(target, block_size=8, sequential_head=head, markov_rank=32, draft_vocab_size=4096,
                           use_confidence_head=head != "none")
    list(_check(target, drafter, prompt_ids, references, 8, 64))


@pytest.mark.parametrize("head", ["none", "markov", "rnn"])
@pytest.mark.parametrize("draft_vocab", [None, 24])
def test_greedy_drafting_equals_the_processed_logits_path(head, draft_vocab):
    """`draft_round` greedy without a sampler (argmax in the draft vocabulary, no logits kept) gives the tokens,
    confidences and ℓ of the path over processed [1, V] logits (a Sampler without processors), for every head,
    with and without a draft vocabulary, for every policy and budget (random weights, non-zero corrections, uneven
    STS temperatures); and a batch of R = 3 requests drafts what each drafts alone."""
    from dspark.generation.round import RequestState
    from dspark.generation.drafting import DraftContext, Sampler, draft_round
    from dspark.generation.kv import RequestKV
    from dspark.generation.policies import parse_policy

    from .conftest import make_drafter, tiny_target

    target = tiny_target(vocab_size=64, seed=1)
    drafter = make_drafter(target, block_size=6, seed=2, sequential_head=head, draft_vocab_size=draft_vocab,
                           markov_rank=8, sts_temperatures=[0.5, 1.0, 2.0, 4.0, 0.8, 3.0])
    torch.manual_seed(3)
    with torch.no_grad():
        if draft_vocab:
            drafter.draft_vocab_ids.copy_(torch.randperm(64)[:draft_vocab].sort().values)
        if drafter.sequential_head is not None:
            drafter.sequential_head.out.weight.normal_(0, 2.0)  # a correction that changes the argmax
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    feats = [torch.randn(1, n, width) for n in (4, 7, 2)]
    anchors, positions = [13, 7, 3], [4, 7, 2]
    ids = torch.tensor([[1, 5, 9, 13]])

    def context(r):
        return DraftContext(RequestKV(drafter.config.num_draft_layers), [feats[r]])

    sps = {b: 100.0 - b for b in range(1, 30)}
    specs = ["full", "fixed:2", "threshold:0.3", "scheduler"] + (["lagged:1"] if head != "none" else [])
    lengths = set()
    for spec in specs:
        spec = parse_policy(spec)
        if spec.needs_confidence and head == "none":
            continue
        policy = spec.start(sps=sps)
        for budget in (1, 3, 6):
            outs = []
            for sampler in (None, Sampler(False, None, ids)):
                plan = policy.plan([RequestState(None, None)], [budget], [[]], 4)
                outs.append(draft_round(drafter, [context(0)], anchors[:1], positions[:1], plan, policy,
                                        block_size=6, sampler=sampler))
            fast, slow = outs
            assert fast.tokens == slow.tokens and fast.lengths == slow.lengths, (spec, budget)
            assert fast.confidences[0] == pytest.approx(slow.confidences[0], abs=1e-6)
            assert fast.logits[0] is None and (slow.logits[0] is None) == (not slow.tokens[0])
            lengths.add(fast.lengths[0])
            if spec.kind in ("full", "fixed", "threshold"):  # per-request policies: batching changes nothing
                plan = policy.plan([RequestState(None, None)] * 3, [budget, 2, budget], [[]] * 3, 4)
                batch = draft_round(drafter, [context(r) for r in range(3)], anchors, positions, plan, policy,
                                    block_size=6)
                for r, b in enumerate(plan.budgets):
                    alone = draft_round(drafter, [context(r)], anchors[r : r + 1], positions[r : r + 1],
                                        policy.plan([RequestState(None, None)], [b], [[]], 4), policy, block_size=6)
                    assert batch.tokens[r] == alone.tokens[0] and batch.lengths[r] == alone.lengths[0], (spec, r)
    assert len(lengths) >= 3  # the policies really cut the drafts at different lengths
