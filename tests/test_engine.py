"""Batched speculative decoding (`generation.engine.DSparkEngine`): every row's greedy output equals that prompt's
plain `target.generate()` output (float32), whatever the policy, batch composition, acceptance pattern, finishing
order or join time."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from generation.engine import DSparkEngine, PackedTarget, generate_batch, parse_engine_policy

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


class ScriptedEngine(DSparkEngine):
    """Drafts the reference continuation, corrupted at a per-request position: request r's k-th round gets its
    first `pattern[(r + k) % len(pattern)]` drafts right, then a wrong token. Verify lengths come from the real
    policy code with synthetic confidences."""

    pattern = [0, 3, 6, 1, 2, 5, 4]

    def __init__(self, *a, references, **kw):
        super().__init__(*a, **kw)
        self.references = references  # request id -> full greedy continuation
        self.expected_accepts: dict[int, list[int]] = {}

    def _draft(self, reqs, budgets):
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
        for r, budget in zip(reqs, budgets):
            if budget > 0:
                r.pending_feats = []  # ingested, as the real drafter does (catch-up detection sees the same)
        sps = self._sps_curve(reqs) if self.policy.kind in ("scheduler", "lagged") else None
        lengths = self._policy_lengths(conf, budgets, sps, sum(budgets) // 2)
        lengths = [min(ell, len(t)) for ell, t in zip(lengths, tokens)]
        for r, ell, toks in zip(reqs, lengths, tokens):
            good = self.pattern[(r.id + len(r.stats.rounds)) % len(self.pattern)]
            self.expected_accepts.setdefault(r.id, []).append(min(good, ell))
        return tokens, conf, lengths


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
    assert target.config._attn_implementation != "dspark_packed"  # restored after the forward


def test_engine_argument_errors(tiny):
    target, drafter, *_ = tiny
    with pytest.raises(ValueError, match="unknown engine policy"):
        DSparkEngine(target, drafter, "sometimes")
    with pytest.raises(ValueError, match="bad argument"):
        DSparkEngine(target, drafter, "threshold:1.5")
    with pytest.raises(ValueError, match="SPS"):
        DSparkEngine(target, drafter, "scheduler")
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
    assert parse_engine_policy("lagged").name == "lagged:2"


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
    from generation import collect_stats, dspark_options

    target, _, prompts, max_new, _ = tiny
    drafter = make_drafter(target, block_size=6, sequential_head=head, seed=3, draft_vocab_size=draft_vocab)
    if draft_vocab:  # a reduced draft vocabulary: drafted ids must come back as target ids
        drafter.draft_vocab_ids.copy_(torch.randperm(64, generator=torch.Generator().manual_seed(0))[:draft_vocab])
    expected = []
    for p, n in zip(prompts, max_new):
        with dspark_options(policy="threshold:0.0"), collect_stats() as runs:
            target.generate(torch.tensor([p]), assistant_model=drafter, max_new_tokens=n, do_sample=False)
        expected.append(runs[-1].rounds)
    engine = DSparkEngine(target, drafter, "threshold:0.0", max_batch_size=4)
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
    """A table where one more token always costs more than it can bring: no drafter call at all, output exact;
    with the measured-verify-time correction (whose measurements can be stale) only the periodic re-probes draft."""
    target, drafter, prompts, max_new, refs = tiny
    calls = []
    hook = drafter.register_forward_hook(lambda *a: calls.append(1))
    steep = {b: 100.0 / b**2 for b in range(1, 400)}
    try:
        outs = generate_batch(target, prompts, drafter, "scheduler", max_new_tokens=max_new, sps=steep,
                              sps_correction=False)
        assert [o.output_ids for o in outs] == refs and not calls
        engine = DSparkEngine(target, drafter, "scheduler", sps=steep)
        for p, n in zip(prompts, max_new):
            engine.add_request(p, n)
        assert [o.output_ids for o in engine.run()] == refs
    finally:
        hook.remove()
    summ = engine.stats.summary()
    assert summ["draft_rounds"] <= summ["probe_rounds"] + 1 and summ["draft_rounds"] <= 0.2 * summ["rounds"]


def test_bench_serve_smoke(tmp_path, monkeypatch, capsys):
    """`dspark bench serve` end to end at a toy size (no scheduler policy, so no profiling), plus its helpers."""
    from dspark_cli import bench_cmd
    from dspark_cli.main import main

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
    assert all(r["tokens"] == 6 and r["throughput_tok_s"] > 0 for r in report["results"])
    # the loaded phase ends when the queue is empty and fewer than R requests run: at R = 1 only after the last one
    assert all(r["steady_tokens"] == 6 for r in report["results"] if r["R"] == 1)
    assert all(0 < r["steady_tokens"] <= r["tokens"] and r["steady_tok_s"] > 0 for r in report["results"])
    assert all(r["repeats"] == 2 and len(r["throughput_reps"]) == 2 for r in report["results"])
    assert all(r["throughput_min"] <= r["throughput_tok_s"] <= r["throughput_max"] for r in report["results"])
    assert report["config"]["repeats"] == 2 and report["config"]["warmup_repeats"] == 1
    assert report["config"]["drafting_veto"] is True
    assert report["comparisons"] == []  # no dynamic policy in this run
    assert report["results"][1]["agreement_with_none"] == 1.0  # fp32: speculation changes nothing
    assert out.with_suffix(".png").exists()
    assert "| no speculation |" in capsys.readouterr().out
    rows = [{"R": 1, "policy": p, "throughput_tok_s": t, "per_user_tok_s": t} for p, t in
            [("none", 10.0), ("full", 5.0), ("scheduler", 12.0)]]
    table = bench_cmd.markdown_table(rows, ["none", "full", "scheduler"], [1])
    assert "1.20x vs none" in table
    rows = [dict(r, throughput_min=r["throughput_tok_s"] - 1, throughput_max=r["throughput_tok_s"] + 1) for r in rows]
    table = bench_cmd.markdown_table(rows, ["none", "full", "scheduler"], [1])
    assert "10.0 ±1.0 / 10.0" in table and "1.20x vs none (±18%)" in table  # 1/12 + 1/10
    assert "| DSpark scheduler / best static, steady | – |" in table  # no steady numbers in these rows
    paired = [dict(r, throughput_reps=[r["throughput_tok_s"] - 1, r["throughput_tok_s"] + 1]) for r in rows]
    assert "1.20x vs none (±18%; per rep 1.18–1.22, faster in 2/2, sign test p=0.25)" in bench_cmd.markdown_table(
        paired, ["none", "full", "scheduler"], [1])  # 11/9, 13/11; both faster: p = 1/4
    comp = bench_cmd.comparisons(paired, ["none", "full", "scheduler"], [1])
    assert [(c["R"], c["policy"], c["vs"], c["faster"]) for c in comp] == [(1, "scheduler", "none", 2)]
    assert comp[0]["paired"] == pytest.approx([11 / 9, 13 / 11]) and comp[0]["sign_p"] == 0.25
    # the sign test: P(X >= k) for X ~ Binomial(n, 1/2)
    assert bench_cmd.sign_test_p(10, 10) == 1 / 1024 and bench_cmd.sign_test_p(9, 10) == 11 / 1024
    assert bench_cmd.sign_test_p(0, 5) == 1.0 and bench_cmd.sign_test_p(3, 4) == 5 / 16
    with pytest.raises(ValueError, match="faster"):
        bench_cmd.sign_test_p(4, 3)
    unpaired = bench_cmd.comparisons(rows, ["none", "full", "scheduler"], [1])  # no per-rep lists: no sign test
    assert unpaired[0]["paired"] is None and unpaired[0]["sign_p"] is None and unpaired[0]["vs"] == "none"
    rows = [dict(r, steady_tok_s=s) for r, s in zip(rows, (10.0, 11.0, 13.2))]
    assert "| DSpark scheduler / best static, steady | 1.20x vs full |" in bench_cmd.markdown_table(
        rows, ["none", "full", "scheduler"], [1])
    assert main(["bench", "serve", "--waves", "0"]) == 2
    assert main(["bench", "serve", "--repeats", "0"]) == 2
    assert main(["bench", "serve", "--warmup-repeats", "-1"]) == 2
    assert main(["bench", "serve", "--policies", "bogus"]) == 2
    assert main(["bench"]) == 2


# ---------------------------------------------------------------------------------------------- draft cost / gate
class OracleEngine(ScriptedEngine):
    """Every draft is the target's own continuation (all accepted); confidences come from `conf_fn(round index)`.
    Records the draft gate's decision of every round."""

    pattern = [10**6]

    def __init__(self, *a, conf_fn=lambda t: 0.95, **kw):
        kw.setdefault("sps_correction", False)  # decisions against the synthetic SPS table as given
        super().__init__(*a, **kw)
        self.conf_fn = conf_fn
        self.decisions = []

    def _gate(self, reqs, budgets):
        out = super()._gate(reqs, budgets)
        self.decisions.append((len(self.stats.rounds), [r.id for r in reqs], list(out[0]), list(out[1]), out[2]))
        return out

    def _draft(self, reqs, budgets):
        tokens, conf, lengths = super()._draft(reqs, budgets)
        c = self.conf_fn(len(self.stats.rounds))
        conf = [[c] * self.block_size for _ in reqs]
        sps = self._round_sps(reqs, sum(b > 0 for b in budgets))
        lengths = self._policy_lengths(conf, budgets, sps, sum(budgets) // 2)
        return tokens, conf, [min(ell, len(t)) for ell, t in zip(lengths, tokens)]


@pytest.fixture(scope="module")
def long_refs(tiny):
    target, _, prompts, _, _ = tiny
    max_new = [40, 60, 30, 50]
    return max_new, [_reference(target, p, n) for p, n in zip(prompts, max_new)]


@pytest.mark.parametrize("policy", ["scheduler", "lagged"])
def test_gate_skips_useless_drafter(tiny, policy):
    """A random drafter (its confidences ~0.5, nothing accepted) at a 5 ms draft cost: the gate skips the drafter in
    most rounds (re-probing now and then) and the outputs stay exact."""
    target, _, prompts, max_new, refs = tiny
    drafter = make_drafter(target, block_size=6, seed=5)
    calls = []
    hook = drafter.register_forward_hook(lambda *a: calls.append(1))
    try:
        engine = DSparkEngine(target, drafter, policy, sps=SPS, max_batch_size=4, draft_cost_ms=5.0,
                              sps_correction=False)
        for p, n in zip(prompts, max_new):
            engine.add_request(p, n)
        outs = engine.run()
    finally:
        hook.remove()
    assert [o.output_ids for o in outs] == refs
    summ = engine.stats.summary()
    rounds = summ["rounds"]
    assert len(calls) == summ["draft_rounds"] <= 0.35 * rounds
    assert summ["skipped_draft_rounds"] >= 0.65 * rounds and summ["probe_rounds"] >= 1
    # a re-probe drafts the one request skipped longest, not every gated one
    assert all(sum(d > 0 for d in r.drafted) <= 1 for r in engine.stats.rounds if r.probe)
    acc, ver = engine.yield_prior(4)
    assert acc < 0.25 and acc <= 0.5 * max(ver, 0.01)  # confident but rarely right: its realized yield is low
    # the same drafter without the gate drafts every round
    ungated = DSparkEngine(target, drafter, policy, sps=SPS, max_batch_size=4, draft_cost_ms=5.0, draft_gating=False,
                           sps_correction=False)
    for p, n in zip(prompts, max_new):
        ungated.add_request(p, n)
    assert [o.output_ids for o in ungated.run()] == refs
    assert ungated.stats.summary()["skipped_draft_rounds"] <= 1


@pytest.mark.parametrize("policy", ["scheduler", "lagged"])
def test_gate_keeps_drafting_oracle(tiny, long_refs, policy):
    """Drafts that are always right with confidence 0.95: the gate never skips, many tokens per round."""
    target, drafter, prompts, _, _ = tiny
    max_new, refs = long_refs
    engine = OracleEngine(target, drafter, policy, sps=SPS, max_batch_size=4, draft_cost_ms=5.0,
                          references=dict(enumerate(refs)), drafting_veto=False)  # the cost model alone (the
    for p, n in zip(prompts, max_new):                                          # veto's windows read the clock)
        engine.add_request(p, n)
    assert [o.output_ids for o in engine.run()] == refs
    summ = engine.stats.summary()
    assert summ["gated_request_rounds"] == 0 and summ["probe_rounds"] == 0
    assert len(engine.decisions) == len(engine.stats.rounds)
    for (_, _, budgets, _, _), rnd in zip(engine.decisions, engine.stats.rounds):
        assert rnd.drafted_any == any(budgets)  # drafted whenever some request had room for a draft token
    assert summ["tau"] > 3


def test_gate_uses_past_rounds_only(tiny, long_refs):
    """The gate's decision for round t is the same whatever the confidences of round t (and later) are: two runs
    whose confidences differ from round T on decide identically up to and including round T, then diverge."""
    target, drafter, prompts, _, _ = tiny
    max_new, refs = long_refs
    switch = 3
    runs = []
    for conf_fn in (lambda t: 0.9, lambda t: 0.9 if t < switch else 0.0):
        engine = OracleEngine(target, drafter, "scheduler", sps=SPS, max_batch_size=4, draft_cost_ms=5.0,
                              references=dict(enumerate(refs)), conf_fn=conf_fn,
                              drafting_veto=False)  # the veto's windows read the clock: not reproducible
        for p, n in zip(prompts, max_new):
            engine.add_request(p, n)
        assert [o.output_ids for o in engine.run()] == refs
        runs.append(engine.decisions)
    a, b = runs
    assert [d[0] for d in a[: switch + 1]] == list(range(switch + 1))
    assert a[: switch + 1] == b[: switch + 1]
    assert any(any(d[3]) for d in b[switch + 1 :])  # later rounds react to the (past) zero confidences
    assert not any(any(d[3]) for d in a)


def test_draft_cost_auto_measures_and_prices(tiny):
    """"auto" learns the drafting time per number of drafting requests; the policy sees SPS_eff."""
    target, drafter, prompts, max_new, refs = tiny
    engine = DSparkEngine(target, drafter, "scheduler", sps=SPS, max_batch_size=4)
    assert engine._draft_seconds(2) == 0.0  # nothing measured yet
    for p, n in zip(prompts, max_new):
        engine.add_request(p, n)
    assert [o.output_ids for o in engine.run()] == refs
    assert engine._draft_ms_ema and all(v > 0 for v in engine._draft_ms_ema.values())
    n = min(engine._draft_ms_ema)
    assert engine._draft_seconds(n) == pytest.approx(engine._draft_ms_ema[n] / 1e3)
    fixed = DSparkEngine(target, drafter, "lagged", sps=SPS, draft_cost_ms=4.0)
    assert fixed._draft_seconds(3) == pytest.approx(0.004) and fixed._draft_seconds(0) == 0.0
    assert DSparkEngine(target, drafter, "lagged", sps=SPS, draft_cost_ms=None)._draft_seconds(3) == 0.0


def test_draft_gate_option_errors(tiny):
    target, drafter, *_ = tiny
    for bad in ("fast", -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="draft_cost_ms"):
            DSparkEngine(target, drafter, "scheduler", sps=SPS, draft_cost_ms=bad)
    with pytest.raises(ValueError, match="draft_gating"):
        DSparkEngine(target, drafter, "scheduler", sps=SPS, draft_gating="yes")
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="probe_max_interval"):
            DSparkEngine(target, drafter, "scheduler", sps=SPS, probe_max_interval=bad)
    with pytest.raises(ValueError, match="drafting_veto"):
        DSparkEngine(target, drafter, "scheduler", sps=SPS, drafting_veto=1)


def test_yield_estimate_shrinks_toward_prior(tiny):
    """The gate's per-request yield: decayed own rounds mixed with YIELD_PRIOR_ROUNDS rounds of the per-R prior,
    which is the plain mean of the first drafted request-rounds and falls back to the nearest R."""
    from generation.engine import _Request

    target, drafter, *_ = tiny
    engine = DSparkEngine(target, drafter, "scheduler", sps=SPS)
    a, b = (_Request(i, [1, 2], 5, engine.packed.new_cache(16)) for i in range(2))
    assert engine.yield_prior(2) is None and engine.yield_estimate(a, None) is None
    engine._update_yield(a, 2, 0, 4)
    assert engine.yield_estimate(a, None) == [0.0, 4.0]
    assert engine.yield_prior(2) == [0.0, 4.0] and engine.yield_prior(5) == [0.0, 4.0]  # nearest R with data
    engine._update_yield(b, 2, 2, 4)
    assert engine.yield_prior(2) == pytest.approx([1.0, 4.0])  # mean of the first rounds, not the latest
    k = engine.YIELD_PRIOR_ROUNDS
    assert engine.yield_estimate(a, [1.0, 4.0]) == pytest.approx([k / (1 + k), 4.0])
    engine._update_yield(a, 2, 3, 3)  # decayed sums: 0.8 · (0, 4, 1) + (3, 3, 1)
    d = engine.YIELD_DECAY
    assert a.yield_sums == pytest.approx([3.0, 4 * d + 3, d + 1])
    assert engine.yield_estimate(a, [0.0, 0.0]) == pytest.approx([3 / (d + 1 + k), (4 * d + 3) / (d + 1 + k)])


def test_verify_correction_fits_measured_times(tiny):
    """The measured-verify-time correction: the residual (measured − 1/SPS(B)) as a decayed mean o0 over rounds
    with B = R and a decayed least-squares line o1 + s · (B − R − 1) over rounds with B > R, applied as
    SPS'(B) = 1 / max(½ / SPS(B), t'(B)); slope clipped at 0; a step at the first draft token is not read as a
    slope; off when disabled."""
    from generation.engine import VerifyCorrection, _Request

    target, drafter, *_ = tiny
    sps = {b: 100.0 for b in range(1, 40)}  # the table says 10 ms whatever B
    engine = DSparkEngine(target, drafter, "scheduler", sps=sps)
    reqs = [_Request(i, [1], 4, engine.packed.new_cache(8)) for i in range(2)]
    assert engine.verify_correction(2) is None and engine._sps_curve(reqs) is sps
    engine._record_verify_time(reqs, 2, 0.012)  # B = R only: a pure offset, borrowed by the drafting part
    assert engine.verify_correction(2) == pytest.approx((0.002, 0.002, 0.0))
    for _ in range(10):
        for b in (3, 5, 7, 9):  # drafting rounds: 12 ms + 1 ms per draft token beyond the first
            engine._record_verify_time(reqs, b, 0.012 + 0.001 * (b - 3))
    fit = engine.verify_correction(2)
    assert isinstance(fit, VerifyCorrection)
    assert 0.0007 < fit.slope < 0.001  # ridge-shrunk toward 0 (spread of B − R − 1: 5 tokens², prior ~1)
    assert fit.offset_draft == pytest.approx(0.002, abs=0.0006)
    assert fit.offset_none == pytest.approx(0.002)  # the B = R mean is not moved by drafting rounds
    curve = engine._sps_curve(reqs)
    assert curve(2) == pytest.approx(1 / 0.012, rel=1e-3)
    assert curve(10) == pytest.approx(1 / (0.010 + fit.offset_draft + 7 * fit.slope), rel=1e-3)
    # a step at the first draft token (B = R: 10 ms; any B > R: 15 ms flat) is an offset, not a slope
    step = DSparkEngine(target, drafter, "scheduler", sps=sps)
    for _ in range(20):
        for b in (2, 2, 3, 5, 9):
            step._record_verify_time(reqs, b, 0.010 if b == 2 else 0.015)
    fit = step.verify_correction(2)
    assert fit.slope == pytest.approx(0.0, abs=1e-9)
    assert fit.offset_none == pytest.approx(0.0, abs=1e-9)
    w = step._verify_fit[2][1][0]  # decayed weight of the drafting rounds
    assert fit.offset_draft == pytest.approx(0.005 * w / (w + step.VERIFY_STEP_PRIOR))  # shrunk toward o0 = 0
    curve = step._sps_curve(reqs)
    assert curve(2) == pytest.approx(100.0)
    assert curve(3) == pytest.approx(curve(10))
    assert curve(3) == pytest.approx(1 / (0.010 + fit.offset_draft), rel=1e-3)
    # a long run of drafting rounds leaves o0 where it was (no aging of a mean into float underflow)
    busy = DSparkEngine(target, drafter, "scheduler", sps=sps)
    busy._record_verify_time(reqs, 2, 0.012)
    for _ in range(30_000):
        busy._record_verify_time(reqs, 5, 0.013)
    fit = busy.verify_correction(2)
    assert fit.offset_none == pytest.approx(0.002) and fit.offset_draft == pytest.approx(0.003, rel=0.1)
    for _ in range(30_000):  # and the drafting part's sums reset, not underflow, while only B = R rounds run
        busy._record_verify_time(reqs, 2, 0.012)
    assert busy.verify_correction(2) == pytest.approx((0.002, 0.002, 0.0))
    # a stalled drafting round fades (slope and step) while only B = R rounds follow: no frozen skip
    stale = DSparkEngine(target, drafter, "scheduler", sps=sps)
    for _ in range(30):
        stale._record_verify_time(reqs, 2, 0.010)
        stale._record_verify_time(reqs, 3, 0.010)
    stale._record_verify_time(reqs, 4, 0.5)  # a stall, clipped at 3x the table
    assert stale.verify_correction(2).slope > 0.0005  # already damped by the ridge
    assert stale.verify_correction(2).offset_draft > 0.0005
    for _ in range(200):
        stale._record_verify_time(reqs, 2, 0.010)
    assert stale.verify_correction(2).slope < 0.00005
    assert stale.verify_correction(2).offset_draft == pytest.approx(0.0, abs=0.0002)
    assert engine.verify_correction(1) is None  # per R
    # the table over-states the time: the correction never makes a round faster than half the table's
    fast = DSparkEngine(target, drafter, "scheduler", sps=sps)
    fast._record_verify_time(reqs, 2, 0.001)
    assert fast._sps_curve(reqs)(2) == pytest.approx(200.0)
    # falling measured times give slope 0, and a first draft token measured cheaper than B = R is priced as B = R
    # (SPS' stays non-increasing in B)
    falling = DSparkEngine(target, drafter, "scheduler", sps=sps)
    falling._record_verify_time(reqs, 2, 0.012)
    for b in (3, 7):
        falling._record_verify_time(reqs, b, 0.010 - 0.001 * (b - 3))
    assert falling.verify_correction(2).slope == 0.0
    curve = falling._sps_curve(reqs)
    assert [curve(b) for b in (2, 3, 7)] == pytest.approx([1 / 0.012] * 3)
    off = DSparkEngine(target, drafter, "scheduler", sps=sps, sps_correction=False)
    off._record_verify_time(reqs, 2, 0.5)
    assert off.verify_correction(2) is None and off._sps_curve(reqs) is sps
    with pytest.raises(ValueError, match="sps_correction"):
        DSparkEngine(target, drafter, "scheduler", sps=sps, sps_correction="yes")


class ForcedSkipEngine(DSparkEngine):
    """Request 1 is kept from drafting in every other round (its drafter context then catches up on several
    pending pieces); records the draft tokens of every request at each output length."""

    def __init__(self, *a, skip=True, **kw):
        super().__init__(*a, **kw)
        self.skip, self.drafts = skip, {}

    def _gate(self, reqs, budgets):
        budgets, gated, probe = super()._gate(reqs, budgets)
        if self.skip and len(self.stats.rounds) % 2:
            budgets = [0 if r.id == 1 else b for r, b in zip(reqs, budgets)]
        return budgets, gated, probe

    def _draft(self, reqs, budgets):
        tokens, conf, lengths = super()._draft(reqs, budgets)
        for r, t, b in zip(reqs, tokens, budgets):
            if b > 0:
                self.drafts[(r.id, len(r.output))] = list(t)
        return tokens, conf, lengths


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


def test_catch_up_rounds_are_not_timed(tiny):
    """The first drafting round after a prefill longer than γ + 1 ingests the whole prompt: its drafting time is not
    a steady-state sample of t_draft."""
    target, drafter, prompts, _, _ = tiny
    engine = DSparkEngine(target, drafter, "scheduler", sps=SPS)
    long_prompt = max(prompts, key=len)
    assert len(long_prompt) > engine.block_size + 1
    engine.add_request(long_prompt, 20)
    engine.step()
    assert engine.stats.rounds[0].drafted_any and not engine._draft_ms_ema
    engine.step()
    assert list(engine._draft_ms_ema) == [1]


def test_long_catch_up_rounds_do_not_feed_the_draft_excess(tiny):
    """A drafting round whose drafter first ingests more than two rounds' worth of positions (here the prompt) pays
    that catch-up whenever it drafts, now or later: it is left out of draft_excess, as out of the veto's rates; the
    next (steady) drafting round at the same R is folded in."""
    target, drafter, prompts, _, _ = tiny
    engine = DSparkEngine(target, drafter, "scheduler", sps=SPS, draft_gating=False)  # no yield gate
    engine._record_draft_time(1, 5.0)  # drafting time measured: drafting rounds are modelled, their excess kept
    long_prompt = max(prompts, key=len)
    assert len(long_prompt) > 2 * (engine.block_size + 1)
    engine.add_request(long_prompt, 30)
    engine.step()
    assert engine.stats.rounds[0].drafted_any and 1 not in engine._excess
    engine.step()
    assert engine.stats.rounds[1].drafted_any and not engine.stats.rounds[1].probe and 1 in engine._excess


def test_reprobe_rounds_only_lower_the_draft_excess(tiny):
    """A re-probe after gated rounds first catches up on them: its residual over-states a steady round's, so it is
    folded into draft_excess only when below the current excess -- it cannot hold the gate closed, and an excess
    that steady rounds left high still comes down while only re-probes draft."""
    target, drafter, prompts, _, _ = tiny
    engine = DSparkEngine(target, drafter, "scheduler", sps=SPS, drafting_veto=False)
    engine._record_draft_time(1, 5.0)
    engine._record_excess(1, 0.030, 0.020)  # a steady drafting round: 10 ms over the model
    engine._record_excess(1, 0.040, 0.020, upper_bound=True)  # a re-probe 20 ms over: left out
    assert engine.draft_excess(1) == pytest.approx(0.010)
    engine._record_excess(1, 0.025, 0.020, upper_bound=True)  # a re-probe 5 ms over: lowers it
    d = DSparkEngine.EXCESS_DECAY
    assert engine.draft_excess(1) == pytest.approx((d * 0.010 + 0.005) / (d + 1))
    engine._record_excess(2, 0.0, 0.020, upper_bound=True)  # no excess at R = 2 yet: nothing to bound
    assert 2 not in engine._excess
    # a real run: an excess left high (10 s) holds the gate closed; the re-probes (each residual at most one
    # modelled round, so below it however slow the machine) bring it down
    engine._excess[1] = (1.0, 10.0)
    engine.add_request(max(prompts, key=len), 200)  # the first re-probe catches up on the whole prompt: counted too
    while engine.has_unfinished() and sum(r.probe and r.drafted_any for r in engine.stats.rounds) < 3:
        engine.step()
    probes = [r for r in engine.stats.rounds if r.probe and r.drafted_any]
    assert len(probes) == 3 and all(not r.drafted_any for r in engine.stats.rounds[1:] if not r.probe)
    w, _ = engine._excess[1]
    assert w == pytest.approx(d ** 3 + d ** 2 + d + 1)  # the three re-probes folded in
    assert engine.draft_excess(1) < 10.0


def test_steady_gated_drafting_rounds_feed_the_draft_excess(tiny):
    """With the gate on and a drafter that yields, the gate drafts in steady (non-probe) rounds, and those feed
    draft_excess; outputs stay exact."""
    target, drafter, prompts, max_new, refs = tiny
    engine = ScriptedEngine(target, drafter, "scheduler", sps=SPS, max_batch_size=4,
                            references=dict(enumerate(refs)))
    assert [o.output_ids for o in _run_with_join(engine, prompts, max_new, join_after=1)] == refs
    steady = {r.requests for r in engine.stats.rounds if r.drafted_any and not r.probe}
    assert steady and set(engine._excess) & steady


def test_draft_excess_prices_what_drafting_rounds_cost_beyond_the_model(tiny):
    """draft_excess: a decayed mean of (measured − modelled) time of drafting rounds per R, added to the drafting
    time the gate prices (never below 0 in total); a stall counts as at most one more modelled round; only with
    draft_cost_ms="auto"."""
    target, drafter, *_ = tiny
    engine = DSparkEngine(target, drafter, "scheduler", sps=SPS)
    assert engine.draft_excess(4) == 0.0 and engine._draft_price(4, 1) == 0.0  # nothing measured: unpriced
    engine._record_draft_time(1, 5.0)
    assert engine._draft_price(4, 1) == pytest.approx(0.005)
    engine._record_excess(4, 0.060, 0.050)  # 10 ms more than modelled
    assert engine.draft_excess(4) == pytest.approx(0.010) and engine.draft_excess(2) == 0.0  # per R
    assert engine._draft_price(4, 1) == pytest.approx(0.015)
    engine._record_excess(4, 0.050, 0.050)
    d = DSparkEngine.EXCESS_DECAY
    assert engine.draft_excess(4) == pytest.approx(d * 0.010 / (d + 1))
    engine._record_excess(4, 5.0, 0.050)  # a stall: at most one more modelled round
    assert engine.draft_excess(4) == pytest.approx((d * d * 0.010 + 0.050) / (d * d + d + 1))
    for _ in range(50):
        engine._record_excess(2, 0.010, 0.050)  # the model over-states: the price falls, but not below 0
    assert engine.draft_excess(2) == pytest.approx(-0.040) and engine._draft_price(2, 1) == 0.0
    fixed = DSparkEngine(target, drafter, "scheduler", sps=SPS, draft_cost_ms=4.0)
    fixed._record_excess(4, 0.060, 0.050)
    assert fixed.draft_excess(4) == 0.0 and fixed._draft_price(4, 1) == pytest.approx(0.004)


def test_draft_excess_is_measured_in_real_rounds_and_outputs_stay_exact(tiny):
    """A real run with the measured draft cost: the R that drafted in steady rounds get an excess estimate from
    their own drafting rounds, and the outputs equal plain greedy generation. (The gate is off: with this random
    drafter it would draft only in re-probes, which the excess leaves out.)"""
    target, drafter, prompts, max_new, refs = tiny
    engine = DSparkEngine(target, drafter, "scheduler", sps=SPS, max_batch_size=4, draft_gating=False)
    for p, n in zip(prompts, max_new):
        engine.add_request(p, n)
    assert [o.output_ids for o in engine.run()] == refs
    assert engine._excess and all(w > 0 for w, _ in engine._excess.values())
    drafted_at = {r.requests for r in engine.stats.rounds if r.drafted_any}
    assert set(engine._excess) <= drafted_at


def test_probe_back_off_is_per_concurrency(tiny):
    """The re-probe back-off of one R neither resets nor advances that of another."""
    from generation.engine import _Request

    target, drafter, *_ = tiny
    engine = DSparkEngine(target, drafter, "scheduler", sps=SPS, probe_max_interval=8)

    def reqs(n):
        return [_Request(i, [1], 4, engine.packed.new_cache(8)) for i in range(n)]

    four, two = reqs(4), reqs(2)
    probes = [engine._skip_or_probe(four, [3] * 4, [0] * 4, [True] * 4)[2] for _ in range(12)]
    assert probes == [False, True, False, False, True, False, False, False, False, True, False, False]  # 1, 2, 4
    engine._skip_or_probe(two, [3] * 2, [0] * 2, [True] * 2)
    assert engine._probe_state[4] == [8, 2] and engine._probe_state[2] == [1, 1]


class SlowOracleEngine(OracleEngine):
    """An oracle drafter (every draft right, confidence 0.95) whose drafting takes `DRAFT_SLEEP_S` more than the
    cost model knows (``draft_cost_ms=0``): drafting rounds are slower per token than rounds without drafting."""

    DRAFT_SLEEP_S = 0.1

    def _draft(self, reqs, budgets):
        time.sleep(self.DRAFT_SLEEP_S)
        return super()._draft(reqs, budgets)


def test_drafting_veto_stops_drafting_that_measures_slower_and_lifts(tiny):
    """Drafting that the cost model prices as free but that measures slower than rounds without drafting: the
    engine pairs each window's drafting rounds with a round without drafting, and once RoundRates.MIN_WINDOWS windows
    measured drafting slower the veto skips the drafter at R = 2, re-probing with the back-off (one request for
    VETO_PROBE_ROUNDS rounds at a time); without the veto the model-gated engine drafts every round. When drafting
    then gets fast, the probes lift the veto. Outputs stay exact throughout."""
    from generation.round_rates import RoundRates

    target, drafter, prompts, _, _ = tiny
    prompts, max_new = prompts[1:3] * 2, [400] * 4
    refs = [_reference(target, p, n) for p, n in zip(prompts, max_new)]
    runs = {}
    for veto in (True, False):
        engine = SlowOracleEngine(target, drafter, "scheduler", sps=SPS, max_batch_size=2, draft_cost_ms=0.0,
                                  references=dict(enumerate(refs)), drafting_veto=veto, probe_max_interval=4)
        engine.round_rates.WINDOW_S = 0.25  # windows of ~2 drafting rounds at 0.1 s each: a short test
        engine.round_rates.WINDOW_ROUNDS = 2
        for p, n in zip(prompts[:2], max_new[:2]):
            engine.add_request(p, n)
        assert [o.output_ids for o in engine.run()] == refs[:2]
        runs[veto] = engine
    vetoed, free = runs[True], runs[False]
    rounds = list(vetoed.stats.rounds)
    assert vetoed.round_rates.drafting_loses(2)
    assert vetoed.round_rates.ratio(2) < 1.0 - RoundRates.MARGIN
    assert vetoed.round_rates.paired_windows(2) >= RoundRates.MIN_WINDOWS
    assert free.stats.summary()["skipped_draft_rounds"] == 0  # the model alone never sees the cost
    # before the veto, rounds without drafting come one at a time, to pair the windows ...
    first_skip = next((i for i, r in enumerate(rounds) if r.veto == "skip"), None)
    assert first_skip is not None
    before = rounds[:first_skip]
    assert any(r.drafted_any for r in before)
    assert all(r.veto == "pair" for r in before if not r.drafted_any)
    assert all(before[i + 1].drafted_any for i, r in enumerate(before) if r.veto == "pair" and i + 1 < len(before))
    # ... after it, drafting only in probes of VETO_PROBE_ROUNDS consecutive rounds, with a growing back-off
    vetoed_rounds = [r for r in rounds[first_skip:] if r.requests == 2 and (any(r.gated) or r.drafted_any)]
    marks = "".join({"skip": ".", "probe": "P"}.get(r.veto, "?") for r in vetoed_rounds)  # (not: no room to draft)
    assert set(marks) <= {".", "P"}, marks
    runs_of_p = [len(x) for x in marks.strip(".").split(".") if x]
    assert runs_of_p and all(n == vetoed.VETO_PROBE_ROUNDS for n in runs_of_p[:-1]), marks
    gaps = [len(x) for x in marks.strip(".").split("P") if x]
    assert gaps == sorted(gaps) and max(gaps, default=0) <= vetoed.probe_max_interval, marks
    assert all(r.drafted_any == (r.veto == "probe") for r in vetoed_rounds)
    # drafting gets fast: the probes' paired samples lift the veto, and the engine drafts again
    vetoed.DRAFT_SLEEP_S = 0.0
    vetoed.round_rates.WINDOW_S = 0.05  # rounds of a few ms now: windows of several rounds, which the slow
    vetoed.round_rates.MEAN_DECAY = 0.5  # rounds of before would stretch (WINDOW_ROUNDS) for a while
    for p, n in zip(prompts[2:], max_new[2:]):
        vetoed.add_request(p, n)
    assert [o.output_ids for o in vetoed.run()] == refs[2:]
    assert not vetoed.round_rates.drafting_loses(2)
    later = [r for r in vetoed.stats.rounds[len(rounds):] if r.requests == 2]
    lifted = later[max((i for i, r in enumerate(later) if r.veto in ("skip", "probe")), default=-1) + 1:]
    assert len(lifted) >= 8  # the veto lifted well before the end and stayed lifted
    assert sum(r.drafted_any for r in lifted) >= 0.6 * len(lifted)  # the rest: pairing rounds, one per window


def test_round_rates_pair_drafting_and_plain_rounds_within_a_window():
    """RoundRates: a window's sample is the log ratio of its drafting and plain rates, weighted n_d·n_p/(n_d + n_p);
    the veto needs the upper confidence bound of the decayed weighted mean below 1 - MARGIN; windows with one kind
    only give none; the machine's speed changing between windows (drift) does not move the
    ratio, where pooling the rounds would; None before MIN_WINDOWS paired windows; at an unmeasured R the largest
    smaller measured R stands in; a stall counts at most STALL_FACTOR mean rounds; a plain round is due from half-way
    through a drafting-only window until it ends; slow rounds stretch the windows."""
    import math

    from generation.round_rates import RoundRates

    rates = RoundRates()
    t, win = 100.0, RoundRates.WINDOW_S

    def window(r, num, speed, drafting, plain):
        nonlocal t
        for kind, (n, sec, tok) in ((True, drafting), (False, plain)):
            for _ in range(n):
                t += sec / speed
                r.record(num, kind, sec / speed, tok, now=t)
        t += 2 * win  # the next round opens (and closes this) window

    assert rates.ratio(2) is None and not rates.drafting_loses(2)
    window(rates, 2, 1.0, drafting=(3, 0.05, 6), plain=(0, 0.05, 4))  # drafting rounds only: no sample
    # drifting machine: drafting is 1.5x as fast as plain in every window, but the slow windows hold more drafting
    # rounds and the fast ones more plain rounds (pooled: 26.1 vs 30.9 tokens/s, drafting would look slower)
    for speed, n_d, n_p in ((1.0, 2, 2), (0.5, 6, 1), (2.0, 1, 6)):
        window(rates, 2, speed, drafting=(n_d, 0.05, 6), plain=(n_p, 0.05, 4))
    assert rates.paired_windows(2) == 2 and rates.ratio(2) is None  # the last window is still open
    rates.record(2, False, 0.05, 4, now=t)  # closes it
    assert rates.paired_windows(2) == RoundRates.MIN_WINDOWS and rates.ratio(2) == pytest.approx(1.5)
    assert not rates.drafting_loses(2)
    # R = 4: drafting slower in two windows, faster in one, windows of different sizes and speeds
    window(rates, 4, 1.0, drafting=(1, 0.05, 4), plain=(5, 0.05, 5))   # weight 5/6, ratio 0.8
    window(rates, 4, 1.6, drafting=(4, 0.05, 4), plain=(4, 0.05, 5))   # weight 2, ratio 0.8
    window(rates, 4, 0.7, drafting=(2, 0.05, 8), plain=(2, 0.05, 5))   # weight 1, ratio 1.6
    rates.record(4, False, 0.05, 5, now=t)
    d = RoundRates.DECAY

    def expected(samples):  # (weight, ratio), oldest first -> (ratio, upper bound)
        ws = [w * d ** (len(samples) - 1 - i) for i, (w, _) in enumerate(samples)]
        xs = [math.log(r) for _, r in samples]
        mean = sum(w * x for w, x in zip(ws, xs)) / sum(ws)
        var = sum(w * (x - mean) ** 2 for w, x in zip(ws, xs)) / (sum(ws) - sum(w * w for w in ws) / sum(ws))
        se = math.sqrt(var * sum(w * w for w in ws)) / sum(ws)
        return math.exp(mean), math.exp(mean + RoundRates.CONFIDENCE_Z * se)

    samples = [(5 / 6, 0.8), (2, 0.8), (1, 1.6)]
    assert (rates.ratio(4), rates.ratio_upper(4)) == pytest.approx(expected(samples))
    assert rates.ratio(4) < 1 - RoundRates.MARGIN < rates.ratio_upper(4)
    assert not rates.drafting_loses(4)  # slower on average, but too noisy to be sure
    for _ in range(3):
        window(rates, 4, 1.0, drafting=(4, 0.05, 4), plain=(4, 0.05, 5))
    rates.record(4, False, 0.05, 5, now=t)
    samples += [(4 * 5 / 9, 0.8), (2, 0.8), (2, 0.8)]  # the first also holds the plain round that closed the last
    assert (rates.ratio(4), rates.ratio_upper(4)) == pytest.approx(expected(samples))
    assert rates.ratio_upper(4) < 1 - RoundRates.MARGIN and rates.drafting_loses(4)
    assert rates.drafting_loses(5) and rates.drafting_loses(16)  # the largest smaller measured R: 4
    assert not rates.drafting_loses(3) and not rates.drafting_loses(1)  # 2 (drafting pays), none
    # a stall counts at most STALL_FACTOR x the kind's mean round time
    stalled = RoundRates()
    for i in range(4):
        stalled.record(1, True, 0.05, 2, now=10.0 + 0.05 * i)
    stalled.record(1, True, 30.0, 2, now=10.3)
    assert stalled._windows[1]["sums"][True][0] == pytest.approx(4 * 0.05 + RoundRates.STALL_FACTOR * 0.05)
    # plain round due: drafting-only window, from half-way to its end; not once a plain round ran
    due = RoundRates()
    due.record(1, True, 0.05, 2, now=5.0)
    start = 5.0 - 0.05
    assert not due.plain_round_due(1, now=start + 0.3 * win)
    assert due.plain_round_due(1, now=start + 0.5 * win) and due.plain_round_due(1, now=start + win)
    assert not due.plain_round_due(1, now=start + 1.1 * win)  # the window is over: the next round opens another
    due.record(1, False, 0.05, 1, now=start + 0.6 * win)
    assert not due.plain_round_due(1, now=start + 0.9 * win)
    # slow rounds (0.5 s): a window spans WINDOW_ROUNDS of them, not WINDOW_S
    slow = RoundRates()
    for i in range(8):
        slow.record(1, True, 0.5, 3, now=20.0 + 0.5 * (i + 1))
    assert len(slow._windows) == 1 and slow._windows[1]["sums"][True][2] == 8  # 4 s > WINDOW_S, one window
    assert not slow.plain_round_due(1, now=23.0) and slow.plain_round_due(1, now=24.0)  # half of 16 x 0.5 s
    for bad in ((0, True, 0.1, 1), (2, True, 0.0, 1), (2, True, 0.1, -1)):
        with pytest.raises(ValueError, match="bad round"):
            rates.record(*bad)


def test_bench_serve_engines_without_the_veto(tiny):
    """`dspark bench serve --no-drafting-veto` (an ablation) builds its engines with drafting_veto=False."""
    from dspark_cli import bench_cmd
    from dspark_cli.main import build_parser

    target, drafter, *_ = tiny
    assert bench_cmd._engine(target, drafter, "scheduler", 6, SPS).drafting_veto is True
    assert bench_cmd._engine(target, drafter, "scheduler", 6, SPS, drafting_veto=False).drafting_veto is False
    assert build_parser().parse_args(["bench", "serve", "--no-drafting-veto"]).no_drafting_veto is True

