"""Batched speculative decoding (`dspark.generation.engine.DSparkEngine`): every row's greedy output equals that
prompt's plain `target.generate()` output (float32), whatever the policy, batch composition, acceptance pattern,
finishing order or join time."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dspark.generation.round as rnd
from dspark.generation.drafting import DraftResult, draft_round
from dspark.generation.engine import DSparkEngine, generate_batch
from dspark.generation.packed_target import PackedTarget
from dspark.generation.policies import parse_policy

from .conftest import make_drafter

POLICIES = ["none", "fixed:1", "fixed:3", "full", "threshold:0.3", "scheduler", "lagged"]
SPS = {b: 100.0 / (1.0 + 0.08 * b) for b in range(1, 400)}  # synthetic, decreasing: Θ(B) unimodal


# tiny forwards are dominated by thread synchronisation on a busy machine: one thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def varied_target(seed=0, vocab_size=64) -> LlamaForCausalLM:
    """A tiny random Llama whose greedy continuations vary (untied head, larger init), fp32, eval."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=None, pad_token_id=0,
        tie_word_embeddings=False, initializer_range=0.2,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def tiny():
    target = varied_target()
    drafter = make_drafter(target, block_size=6)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 9, 1, 16)]
    max_new = [7, 25, 13, 30]
    refs = [_reference(target, p, n) for p, n in zip(prompts, max_new)]
    return target, drafter, prompts, max_new, refs


def _reference(target, prompt, max_new, **kw):
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


def _run_with_join(engine, prompts, max_new, join_after=2):
    """Add all but the last prompt, step `join_after` times, add the last one (joins mid-way), run to the end."""
    ids = [engine.add_request(p, n) for p, n in zip(prompts[:-1], max_new[:-1])]
    for _ in range(join_after):
        engine.step()
    ids.append(engine.add_request(prompts[-1], max_new[-1]))
    engine.run()
    return [engine.result(i) for i in ids]


# ---------------------------------------------------------------------------------------------- tiny target
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("max_batch", [1, 2, 4])
def test_tiny_rows_identical_every_policy(tiny, policy, max_batch):
    target, drafter, prompts, max_new, refs = tiny
    engine = DSparkEngine(target, drafter, policy, sps=SPS, max_batch_size=max_batch)
    outs = _run_with_join(engine, prompts, max_new)
    for i, (o, ref) in enumerate(zip(outs, refs)):
        assert o.output_ids == ref, f"request {i} differs under {policy}, R<={max_batch}"
        assert o.finish_reason == "length"
    assert max(r.requests for r in engine.stats.rounds) <= max_batch
    assert not engine.has_unfinished()


def test_requests_admitted_beside_a_round(tiny):
    """Requests admitted while others run are prefilled in the running round's forward (one forward per step):
    outputs stay exact, one that ends at its first token (max_new_tokens=1) included, and a round that also
    prefilled teaches the prices nothing."""
    target, drafter, prompts, max_new, refs = tiny
    engine = DSparkEngine(target, drafter, "scheduler", max_batch_size=4)
    forwards = []
    hook = target.register_forward_hook(lambda *a: forwards.append(1))
    try:
        first = engine.add_request(prompts[1], max_new[1])
        engine.step()  # prefill only
        engine.step()  # the first round: unpriced, nothing admitted beside it
        late = [engine.add_request(prompts[0], 1), engine.add_request(prompts[3], max_new[3])]
        prices = engine.policy.prices
        before = (dict(prices.plain), {r: list(x) for r, x in prices._sums.items()},
                  dataclasses.replace(engine.policy.exploration))
        n = len(forwards)
        engine.step()
        assert len(forwards) == n + 1 and engine.num_running == 2  # one forward; the 1-token request finished
        assert (prices.plain, prices._sums, engine.policy.exploration) == before
        engine.run()
    finally:
        hook.remove()
    assert engine.result(first).output_ids == refs[1]
    assert engine.result(late[0]).output_ids == refs[0][:1]
    assert engine.result(late[1]).output_ids == refs[3]


class ScriptedEngine(DSparkEngine):
    """Drafts the reference continuation, corrupted at a per-request position: request r's k-th round gets its
    first `pattern[(r + k) % len(pattern)]` drafts right, then a wrong token. Verify lengths come from the real
    policy code with synthetic confidences. The lookup proposer is off: every verified chain is the scripted draft."""

    pattern = [0, 3, 6, 1, 2, 5, 4]

    def __init__(self, *a, references, **kw):
        super().__init__(*a, **dict(kw, lookup=False))
        self.references = references  # request id -> full greedy continuation
        self.expected_accepts: dict[int, list[int]] = {}

    def _round(self, reqs):
        """The engine's round with its drafting round replaced by :meth:`_draft` (contexts in request order)."""
        with mock.patch.object(rnd, "draft_round", lambda d, c, a, p, plan, policy, **kw: self._draft(
                reqs, plan, policy)):
            super()._round(reqs)

    def _draft(self, reqs, plan, policy):
        budgets = plan.budgets
        tokens, conf = [], []
        for r, budget in zip(reqs, budgets):
            ref = self.references[r.id]
            cur = len(r.output)
            k = len(r.stats.rounds)
            good = self.pattern[(r.id + k) % len(self.pattern)]
            toks = []
            for j in range(budget):
                true = ref[cur + j] if cur + j < len(ref) else 0
                toks.append(true if j < good else (true + 1) % self.target.config.vocab_size)
            tokens.append(toks)
            conf.append([0.9 if j < good else 0.2 for j in range(self.block_size)])
        ingested = [r.draft.num_pending if b > 0 else 0 for r, b in zip(reqs, budgets)]
        for r, budget in zip(reqs, budgets):
            if budget > 0:
                r.draft.pending = []  # ingested, as the real drafter does
        lengths = policy.lengths(plan, torch.tensor(conf, dtype=torch.float64))
        lengths = [min(ell, len(t)) for ell, t in zip(lengths, tokens)]
        for r, ell, toks in zip(reqs, lengths, tokens):
            good = self.pattern[(r.id + len(r.stats.rounds)) % len(self.pattern)]
            self.expected_accepts.setdefault(r.id, []).append(min(good, ell))
        return DraftResult(tokens, lengths, conf, [None] * len(reqs), ingested)


@pytest.mark.parametrize("policy", ["full", "fixed:4", "threshold:0.5", "scheduler"])
def test_tiny_ragged_acceptance(tiny, policy):
    """Different requests accept different numbers of drafts in the same round; outputs stay identical."""
    target, drafter, prompts, max_new, refs = tiny
    engine = ScriptedEngine(target, drafter, policy, sps={b: 100.0 for b in range(1, 400)}, max_batch_size=4,
                            references=dict(enumerate(refs)))
    outs = _run_with_join(engine, prompts, max_new, join_after=1)
    for o, ref in zip(outs, refs):
        assert o.output_ids == ref
        accepted = [r.accepted for r in o.stats.rounds]
        expected = engine.expected_accepts[o.request_id]
        assert accepted == expected + [0] * (len(accepted) - len(expected))  # rounds without drafting accept 0
    ragged = [r for r in engine.stats.rounds if r.requests > 1 and len(set(r.accepted)) > 1]
    assert ragged, "no round had different acceptance counts across requests"
    assert max(max(r.accepted) for r in engine.stats.rounds) >= 3


def test_tiny_eos_stops_each_request(tiny):
    """With an EOS id, each request stops exactly where plain generate() stops (inside accepted blocks too)."""
    target, drafter, prompts, max_new, refs = tiny
    eos = refs[3][4]  # a token the longest request produces early
    eos_refs = [_reference(target, p, n, eos_token_id=eos) for p, n in zip(prompts, max_new)]
    assert any(len(r) < n for r, n in zip(eos_refs, max_new))
    engine = ScriptedEngine(target, drafter, "full", max_batch_size=4, eos_token_id=eos,
                            references=dict(enumerate(refs)))
    outs = _run_with_join(engine, prompts, max_new, join_after=1)
    for o, ref, n in zip(outs, eos_refs, max_new):
        assert o.output_ids == ref
        assert o.finish_reason == ("eos" if len(ref) < n or ref[-1] == eos else "length")


def test_continuous_batching_queue(tiny):
    """More requests than slots: they wait, join as others finish, and all match."""
    target, drafter, prompts, max_new, refs = tiny
    engine = DSparkEngine(target, drafter, "full", max_batch_size=2)
    ids = [engine.add_request(p, n) for p, n in zip(prompts, max_new)]
    assert engine.num_waiting == 4
    first = engine.step()
    assert engine.num_running + len(first) == 2 and engine.num_waiting == 2
    outs = engine.run()
    assert [o.request_id for o in outs] == sorted(set(ids) - {o.request_id for o in first})
    for i, ref in zip(ids, refs):
        assert engine.result(i).output_ids == ref
    assert max(r.requests for r in engine.stats.rounds) <= 2
    res = [engine.result(i) for i in ids]
    assert all(r.t_admitted >= r.t_added and r.t_finished >= r.t_first_token >= r.t_admitted for r in res)


def test_scheduler_lengths_follow_sps(tiny):
    """A flat SPS makes verifying everything worth it; a steep one verifies nothing (Algorithm 1 over R)."""
    target, drafter, prompts, max_new, refs = tiny
    flat = {b: 100.0 for b in range(1, 400)}
    steep = {b: 100.0 / b**3 for b in range(1, 400)}
    e1 = ScriptedEngine(target, drafter, "scheduler", sps=flat, references=dict(enumerate(refs)))
    e2 = ScriptedEngine(target, drafter, "scheduler", sps=steep, references=dict(enumerate(refs)))
    for e in (e1, e2):
        for p, n in zip(prompts, max_new):
            e.add_request(p, n)
        outs = e.run()
        assert [o.output_ids for o in outs] == refs
    assert sum(sum(r.lengths) for r in e1.stats.rounds) > 0
    assert all(sum(r.lengths) == 0 for r in e2.stats.rounds)


def test_packed_forward_matches_separate_forwards(tiny):
    target, _, prompts, _, _ = tiny
    packed = PackedTarget(target)
    caches = [packed.new_cache(4) for _ in prompts]  # small capacity: exercises buffer growth
    logits, _ = packed.forward([(kv, torch.tensor(p)) for kv, p in zip(caches, prompts)])
    off = 0
    with torch.no_grad():
        for p in prompts:
            ref = target(torch.tensor([p])).logits[0]
            torch.testing.assert_close(logits[off : off + len(p)], ref, rtol=1e-4, atol=1e-5)
            off += len(p)
        # verify-shaped step: different numbers of new tokens on caches of different lengths
        new = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
        segments = [(kv, torch.tensor(n)) for kv, n in zip(caches, new)]
        logits, hidden = packed.forward(segments, output_hidden_states=True)
        assert len(hidden) == target.config.num_hidden_layers + 1 and hidden[0].shape[1] == sum(map(len, new))
        off = 0
        for p, n, kv in zip(prompts, new, caches):
            ref = target(torch.tensor([p + n])).logits[0, len(p):]
            torch.testing.assert_close(logits[off : off + len(n)], ref, rtol=1e-4, atol=1e-5)
            assert kv.length == len(p) + len(n)
            off += len(n)
        # two prompts prefilled beside a verify: logits at their last tokens only, the verify's at all of its tokens
        fresh = [packed.new_cache(8) for _ in prompts[:2]]
        logits, _ = packed.forward([(caches[0], torch.tensor([15, 16]))] + [(kv, torch.tensor(p)) for kv, p in
                                                                             zip(fresh, prompts[:2])], last_only=2)
        assert logits.shape[0] == 2 + 2 and [kv.length for kv in fresh] == [len(p) for p in prompts[:2]]
        ref = target(torch.tensor([prompts[0] + new[0] + [15, 16]])).logits[0, -2:]
        torch.testing.assert_close(logits[:2], ref, rtol=1e-4, atol=1e-5)
        for row, p in zip(logits[2:], prompts[:2]):
            torch.testing.assert_close(row, target(torch.tensor([p])).logits[0, -1], rtol=1e-4, atol=1e-5)
    assert target.config._attn_implementation != "dspark_packed"  # restored after the forward


def test_engine_argument_errors(tiny):
    target, drafter, *_ = tiny
    with pytest.raises(ValueError, match="unknown verify policy"):
        DSparkEngine(target, drafter, "sometimes")
    with pytest.raises(ValueError, match=r"threshold:P.*\[0, 1\]"):
        DSparkEngine(target, drafter, "threshold:1.5")
    with pytest.raises(ValueError, match="needs a drafter"):
        DSparkEngine(target, None, "full")
    no_conf = make_drafter(target, block_size=4, use_confidence_head=False)
    with pytest.raises(ValueError, match="confidence head"):
        DSparkEngine(target, no_conf, "threshold:0.5")
    with pytest.raises(ValueError, match="block_size"):
        DSparkEngine(target, drafter, "full", block_size=99)
    engine = DSparkEngine(target, None, "none")
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request([1, 2], 0)
    with pytest.raises(ValueError, match="one prompt"):
        engine.add_request(torch.ones(2, 3, dtype=torch.long), 4)
    assert parse_policy("lagged").name == "lagged:2"


def test_sps_table_too_small_is_a_clear_error(tiny):
    target, drafter, prompts, max_new, _ = tiny
    engine = DSparkEngine(target, drafter, "lagged", sps={b: 10.0 for b in range(1, 5)})
    for p, n in zip(prompts, max_new):
        engine.add_request(p, n)
    with pytest.raises(ValueError, match="B = 5"):
        engine.run()


# ---------------------------------------------------------------------------------------------- real target
@pytest.fixture(scope="module")
def smollm_refs(smollm, prompt_ids):
    target, _ = smollm
    prompts = [prompt_ids[i][0].tolist() for i in (0, 2, 4, 3)]  # 4 different lengths, incl. a 1-token prompt
    max_new = [12, 20, 9, 16]
    refs = [_reference(target, p, n) for p, n in zip(prompts, max_new)]
    return prompts, max_new, refs


@pytest.mark.parametrize("policy", ["full", "scheduler"])
def test_smollm_batched_rows_identical(smollm, random_drafter, smollm_refs, policy):
    """Real SmolLM2 target, fp32: R up to 3 with a 4th request joining mid-way, different max_new_tokens."""
    target, _ = smollm
    prompts, max_new, refs = smollm_refs
    engine = DSparkEngine(target, random_drafter, policy, block_size=8, sps=SPS, max_batch_size=3)
    outs = _run_with_join(engine, prompts, max_new, join_after=3)
    for i, (o, ref) in enumerate(zip(outs, refs)):
        assert o.output_ids == ref, f"request {i} differs ({policy})"
    assert max(r.requests for r in engine.stats.rounds) == 3


def test_smollm_scripted_long_acceptance(smollm, random_drafter, smollm_refs):
    """Real target with drafts that are often right (ragged, multi-token acceptance), generate_batch wrapper."""
    target, _ = smollm
    prompts, max_new, refs = smollm_refs
    engine = ScriptedEngine(target, random_drafter, "full", block_size=8, max_batch_size=4,
                            references=dict(enumerate(refs)))
    for p, n in zip(prompts, max_new):
        engine.add_request(p, n)
    outs = engine.run()
    assert [o.output_ids for o in outs] == refs
    assert sum(sum(r.accepted) for r in engine.stats.rounds) > 10
    outs = generate_batch(target, prompts[:2], None, "none", max_new_tokens=max_new[:2])
    assert [o.output_ids for o in outs] == refs[:2]


@pytest.mark.parametrize("head, draft_vocab", [("markov", None), ("rnn", None), ("markov", 24)])
def test_batched_drafting_matches_generate(tiny, head, draft_vocab):
    """In a batch of 4 (one joining late), each request drafts the same tokens with the same calibrated confidences
    as the batch-size-1 candidate generator in generate(): the batched drafter forward reads exactly the request's
    own context."""
    from dspark.generation import collect_stats, dspark_options

    target, _, prompts, max_new, _ = tiny
    drafter = make_drafter(target, block_size=6, sequential_head=head, seed=3, draft_vocab_size=draft_vocab)
    if draft_vocab:  # a reduced draft vocabulary: drafted ids must come back as target ids
        drafter.draft_vocab_ids.copy_(torch.randperm(64, generator=torch.Generator().manual_seed(0))[:draft_vocab])
    expected = []
    for p, n in zip(prompts, max_new):
        with dspark_options(policy="threshold:0.0", lookup=False), collect_stats() as runs:
            target.generate(torch.tensor([p]), assistant_model=drafter, max_new_tokens=n, do_sample=False)
        expected.append(runs[-1].rounds)
    engine = DSparkEngine(target, drafter, "threshold:0.0", max_batch_size=4, lookup=False)
    outs = _run_with_join(engine, prompts, max_new, join_after=2)
    for o, exp in zip(outs, expected):
        got = [r for r in o.stats.rounds if r.drafted]  # generate() records no round when nothing can be drafted
        assert len(got) == len(exp)
        for g, e in zip(got, exp):
            assert g.draft_tokens == e.draft_tokens
            if draft_vocab:
                assert set(g.draft_tokens) <= set(drafter.draft_vocab_ids.tolist())
            assert g.confidences == pytest.approx(e.confidences, abs=1e-5)


def test_scheduler_skips_drafting_when_no_token_can_pay(tiny):
    """A table where one more token always costs more than it can bring: Algorithm 1 would verify nothing even of
    drafts certain to be accepted, so the drafter never runs; outputs exact."""
    target, drafter, prompts, max_new, refs = tiny
    calls = []
    hook = drafter.register_forward_hook(lambda *a: calls.append(1))
    steep = {b: 100.0 / b**2 for b in range(1, 400)}
    try:
        engine = DSparkEngine(target, drafter, "scheduler", sps=steep, lookup=False)
        for p, n in zip(prompts, max_new):
            engine.add_request(p, n)
        assert [o.output_ids for o in engine.run()] == refs
    finally:
        hook.remove()
    assert all(sum(r.lengths) == 0 for r in engine.stats.rounds)
    assert not calls and engine.stats.summary()["draft_rounds"] == 0


def test_bench_serve_smoke(tmp_path, monkeypatch, capsys, saved_figures):
    """`dspark bench serve` end to end at a toy size (no scheduler policy, so no profiling), plus its helpers."""
    import statistics

    import matplotlib.pyplot as plt

    from dspark.cli.main import main
    from dspark.evaluation import serving

    monkeypatch.setenv("DSPARK_PROFILE_DIR", str(tmp_path / "profiles"))
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--requests", "1", "2", "--policies", "none", "fixed:1", "--datasets", "gsm8k",
               "--limit", "1", "--min-requests", "2", "--waves", "1", "--max-new-tokens", "3", "--dtype", "float32",
               "--drafter", "random", "--repeats", "2", "--out", str(out)])
    assert rc == 0
    import json

    report = json.loads(out.read_text())
    assert [(r["R"], r["policy"]) for r in report["results"]] == [(1, "none"), (1, "fixed:1"), (2, "none"),
                                                                    (2, "fixed:1")]
    assert all(r["tokens"] == 6 for r in report["results"])
    # each repeat's speed is its tokens over its wall time; with two repeats the median wall time is their mean, so
    # tokens / wall_s is the harmonic mean of the two speeds
    for r in report["results"]:
        assert r["tokens"] / r["wall_s"] == pytest.approx(statistics.harmonic_mean(r["throughput_reps"]))
    assert report["config"]["lookup"] is True  # the default; `none` stays plain decoding
    assert all(r["lookup_request_rounds"] == 0 for r in report["results"] if r["policy"] == "none")
    # the loaded phase ends when the queue is empty and fewer than R requests run: at R = 1 only after the last one,
    # so there the steady phase holds every token, timed by a clock that runs inside the whole run's
    for r in (r for r in report["results"] if r["R"] == 1):
        assert r["steady_tokens"] == 6 and all(s >= t for s, t in zip(r["steady_reps"], r["throughput_reps"]))
    assert all(0 < r["steady_tokens"] <= r["tokens"] for r in report["results"])
    assert all(r["steady_min"] <= r["steady_tok_s"] <= r["steady_max"] for r in report["results"])
    assert all(r["repeats"] == 2 and len(r["throughput_reps"]) == 2 for r in report["results"])
    assert all(r["throughput_min"] <= r["throughput_tok_s"] <= r["throughput_max"] for r in report["results"])
    assert report["config"]["repeats"] == 2 and report["config"]["warmup_repeats"] == 1
    assert report["comparisons"] == []  # no dynamic policy in this run
    assert report["results"][1]["agreement_with_none"] == 1.0  # fp32: speculation changes nothing
    # the Pareto plot: one line per policy through its R values, per-user speed against total throughput
    (fig,) = saved_figures
    (ax,) = fig.axes
    cell = {(r["policy"], r["R"]): r for r in report["results"]}
    assert [ln.get_label() for ln in ax.get_lines()] == [serving.policy_label(p) for p in ("none", "fixed:1")]
    for pol, ln in zip(("none", "fixed:1"), ax.get_lines()):
        assert list(ln.get_xdata()) == [cell[pol, R]["per_user_tok_s"] for R in (1, 2)]
        assert list(ln.get_ydata()) == [cell[pol, R]["throughput_tok_s"] for R in (1, 2)]
    assert [t.get_text() for t in ax.texts] == ["R=1", "R=2"] * 2
    assert plt.imread(out.with_suffix(".png")).shape[:2] == (5 * 110, round(7.5 * 110))  # 7.5 x 5 in at 110 dpi
    assert "| no speculation |" in capsys.readouterr().out
    rows = [{"R": 1, "policy": p, "throughput_tok_s": t, "per_user_tok_s": t} for p, t in
            [("none", 10.0), ("full", 5.0), ("scheduler", 12.0)]]
    table = serving.markdown_table(rows, ["none", "full", "scheduler"], [1])
    assert "1.20x vs none" in table
    rows = [dict(r, throughput_min=r["throughput_tok_s"] - 1, throughput_max=r["throughput_tok_s"] + 1) for r in rows]
    table = serving.markdown_table(rows, ["none", "full", "scheduler"], [1])
    assert "10.0 ±1.0 / 10.0" in table and "1.20x vs none (±18%)" in table  # 1/12 + 1/10
    assert "| DSpark scheduler / best static, steady | – |" in table  # no steady numbers in these rows
    paired = [dict(r, throughput_reps=[r["throughput_tok_s"] - 1, r["throughput_tok_s"] + 1]) for r in rows]
    assert "1.20x vs none (±18%; per rep 1.18–1.22, faster in 2/2, sign test p=0.25)" in serving.markdown_table(
        paired, ["none", "full", "scheduler"], [1])  # 11/9, 13/11; both faster: p = 1/4
    comp = serving.comparisons(paired, ["none", "full", "scheduler"], [1])
    assert [(c["R"], c["policy"], c["vs"], c["faster"]) for c in comp] == [(1, "scheduler", "none", 2)]
    assert comp[0]["paired"] == pytest.approx([11 / 9, 13 / 11]) and comp[0]["sign_p"] == 0.25
    # the sign test: P(X >= k) for X ~ Binomial(n, 1/2)
    assert serving.sign_test_p(10, 10) == 1 / 1024 and serving.sign_test_p(9, 10) == 11 / 1024
    assert serving.sign_test_p(0, 5) == 1.0 and serving.sign_test_p(3, 4) == 5 / 16
    with pytest.raises(ValueError, match="faster"):
        serving.sign_test_p(4, 3)
    unpaired = serving.comparisons(rows, ["none", "full", "scheduler"], [1])  # no per-rep lists: no sign test
    assert unpaired[0]["paired"] is None and unpaired[0]["sign_p"] is None and unpaired[0]["vs"] == "none"
    rows = [dict(r, steady_tok_s=s) for r, s in zip(rows, (10.0, 11.0, 13.2))]
    assert "| DSpark scheduler / best static, steady | 1.20x vs full |" in serving.markdown_table(
        rows, ["none", "full", "scheduler"], [1])
    assert main(["bench", "serve", "--waves", "0"]) == 2
    assert main(["bench", "serve", "--repeats", "0"]) == 2
    assert main(["bench", "serve", "--warmup-repeats", "-1"]) == 2
    assert main(["bench", "serve", "--policies", "bogus"]) == 2
    assert main(["bench"]) == 2


# ---------------------------------------------------------------------------------------------- skipped drafting
class ForcedSkipEngine(DSparkEngine):
    """Request 1 is kept from drafting in every other round (its drafter context then catches up on several
    pending pieces); records the draft tokens of every request at each output length. The lookup proposer is off:
    every other request drafts every round."""

    def __init__(self, *a, skip=True, **kw):
        super().__init__(*a, **dict(kw, lookup=False))
        self.skip, self.drafts = skip, {}

    def _round(self, reqs):
        def forced(drafter, contexts, anchors, positions, plan, policy, **kw):
            if self.skip and len(self.stats.rounds) % 2:
                budgets = tuple(0 if r.id == 1 else b for r, b in zip(reqs, plan.budgets))
                plan = dataclasses.replace(plan, budgets=budgets)
            out = draft_round(drafter, contexts, anchors, positions, plan, policy, **kw)
            for r, t, b in zip(reqs, out.tokens, plan.budgets):
                if b > 0:
                    self.drafts[(r.id, len(r.output))] = list(t)
            return out

        with mock.patch.object(rnd, "draft_round", forced):
            super()._round(reqs)


def test_skipped_rounds_keep_the_drafter_context_exact(tiny):
    """A request that skipped drafting catches up on its pending features later: its drafts then equal those of a
    run that drafted every round, at the same output position (float32), and the outputs stay exact."""
    target, drafter, prompts, max_new, refs = tiny
    runs = []
    for skip in (False, True):
        engine = ForcedSkipEngine(target, drafter, "full", max_batch_size=4, skip=skip)
        for p, n in zip(prompts, max_new):
            engine.add_request(p, n)
        assert [o.output_ids for o in engine.run()] == refs
        runs.append(engine.drafts)
    always, skipped = runs
    caught_up = [k for k in skipped if k[0] == 1]
    assert len(caught_up) >= 2 and len(skipped) < len(always)
    for key, toks in skipped.items():
        assert always.get(key) == toks, key


# ---------------------------------------------------------------------------------------------- lookup proposer
@pytest.fixture(scope="module")
def long_refs(tiny):
    target, _, prompts, _, _ = tiny
    max_new = [40, 60, 30, 50]
    return max_new, [_reference(target, p, n) for p, n in zip(prompts, max_new)]


def _serve_all(engine, prompts, max_new):
    for p, n in zip(prompts, max_new):
        engine.add_request(p, n)
    return engine.run()


@pytest.mark.parametrize("policy", ["none", "full", "scheduler"])
def test_lookup_chains_verified_and_exact(tiny, long_refs, policy):
    """With the lookup proposer on (the default), requests verify lookup continuations, some of them accepted, in
    rounds shared with drafting requests; every output equals plain greedy decoding. With it off, no lookup round
    (``none``: plain decoding)."""
    target, drafter, prompts, _, _ = tiny
    max_new, refs = long_refs
    for lookup in (True, False):
        engine = DSparkEngine(target, drafter, policy, sps=SPS, max_batch_size=4, lookup=lookup)
        assert [o.output_ids for o in _serve_all(engine, prompts, max_new)] == refs
        lookup_rounds = [(i, r) for r in engine.stats.rounds for i, s in enumerate(r.sources) if s == "lookup"]
        assert engine.stats.summary()["lookup_request_rounds"] == len(lookup_rounds)
        if not lookup:
            assert not lookup_rounds and all(s in ("draft", "") for r in engine.stats.rounds for s in r.sources)
            continue
        assert sum(r.accepted[i] for i, r in lookup_rounds) > 0
        if policy == "full":  # the scheduler prices drafting and lookups, so with this drafter it may not mix them
            assert any(r.requests > 1 and "draft" in r.sources and "lookup" in r.sources for r in engine.stats.rounds)


def test_lookup_option_errors(tiny):
    target, drafter, *_ = tiny
    with pytest.raises(ValueError, match="lookup must be True or False"):
        DSparkEngine(target, drafter, "full", lookup="yes")


def test_a_drafter_follows_the_target_of_each_call():
    """A drafter drafts for the target of the call using it: generate() and the engine re-bind it from one target
    to another, each output that target's own; while a call for one target drafts with it (on another thread), a
    call for another target is refused before any compute."""
    from .conftest import tiny_target

    first, second = tiny_target(vocab_size=64, seed=0), tiny_target(vocab_size=64, seed=1)
    drafter = make_drafter(first, block_size=4)
    engine = DSparkEngine(first, drafter, "full")
    ids = torch.tensor([[1, 2, 3]])
    for target in (second, first, second):
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=8, do_sample=False)
        assert torch.equal(out, target.generate(ids, max_new_tokens=8, do_sample=False))
        assert drafter.bound_target is target
    engine.add_request([1, 2, 3], 8)
    (res,) = engine.run()
    assert res.output_ids == first.generate(ids, max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    assert drafter.bound_target is first  # the engine's step re-bound it to its own target
    calls = []
    second.register_forward_hook(lambda *a: calls.append(1))
    with drafter.drafting_for(first):  # a call for `first` running
        with pytest.raises(ValueError, match="drafting for another target"):
            second.generate(ids, assistant_model=drafter, max_new_tokens=4, do_sample=False)
        with pytest.raises(ValueError, match="drafting for another target"):
            DSparkEngine(second, drafter, "full")
    assert not calls and drafter.bound_target is first and drafter._holders == 0
    # a target on another device (a GPU, as the drafter's move sees it): bound, the drafter goes there first; a meta
    # target (no weights, e.g. under init_empty_weights) does not take the drafter's weights away
    moves = []
    drafter.to = lambda device: moves.append(str(device))
    elsewhere = tiny_target(vocab_size=64, seed=2)
    with mock.patch.object(type(elsewhere), "device", new_callable=mock.PropertyMock,
                           return_value=torch.device("cuda:1")):
        drafter.bind_target(elsewhere)
    assert moves == ["cuda:1"] and drafter.bound_target is elsewhere
    drafter.bind_target(tiny_target(vocab_size=64, seed=3).to("meta"))
    assert moves == ["cuda:1"]
