"""Interoperability with the real peer implementations (installed by scripts/install_peers.sh).

For z-lab DFlash (``dflash==0.1.0``), SpecForge (``specforge==0.2.0``) and vLLM speculators
(``speculators==0.9.0``): the peer's own code initialises a drafter for a tiny random target and saves it; dspark
loads the directory (:func:`modeling_dspark.formats.load_config_and_state`) and must draft, round by round, the
same tokens and confidences as the peer's own forward at the same committed prefix; greedy ``generate()`` with the
imported drafter equals plain greedy (fp32). The reverse: what ``export_drafter`` writes loads with the peer's
code and drafts the same. A peer that is not installed skips its tests (under CI=true they fail: CI installs them).
"""

from __future__ import annotations

import importlib.util
import json
import unittest.mock

import pytest
import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import modeling_dspark as md
from dspark.generation import products
from dspark.generation.integration import dspark_options
from dspark.generation.stats import collect_stats
from modeling_dspark import export, formats

pytestmark = pytest.mark.usefixtures("one_thread")

MASK = 7  # the mask token id the peers' drafters use (a real id of the tiny vocabulary)
VOCAB = 160
SMALL_VOCAB = 6  # random drafters for a 6-token target get some drafts accepted: multi-token commits happen
SMALL_MASK = 3


def _requires(module: str):
    return pytest.mark.requires(
        importlib.util.find_spec(module) is not None,
        f"peer package {module!r} is not installed (scripts/install_peers.sh installs it; CI runs these)",
    )


needs_dflash = _requires("dflash")
needs_specforge = _requires("specforge")
needs_speculators = _requires("speculators")


def tiny_target(family: str = "qwen3", seed: int = 0, vocab: int = VOCAB):
    """A tiny random target (fp32, eager attention) with 6 layers."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=None,
                 pad_token_id=None, bos_token_id=None)
    if family == "qwen3":
        target = Qwen3ForCausalLM(Qwen3Config(**shape))
    else:
        target = LlamaForCausalLM(LlamaConfig(**shape, rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    target.config._attn_implementation = "eager"
    return target.eval()


def prompt(seed: int = 1, length: int = 9, vocab: int = VOCAB) -> torch.LongTensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(10, vocab - 1), vocab, (1, length), generator=g)


def scale_weights(model: torch.nn.Module, std: float = 0.2, seed: int = 0) -> None:
    """Random weights of a larger scale than the peers' 0.02 init (so drafts and confidences vary), norms at 1 ±."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def dspark_rounds(target, drafter, ids, max_new_tokens=24):
    """Greedy ``generate()`` with ``drafter`` drafting a full block every round.

    Returns ``(output ids, [(committed prefix [1, L], draft tokens, confidences)] per drafting round)``.
    """
    # torch's own BLAS call for every product: the faster-call trials (dspark.generation.products) alternate two calls
    # whose sums differ in the last bits, and two runs are compared float for float
    with collect_stats() as runs, dspark_options(policy="full", lookup=False), \
            unittest.mock.patch.object(products, "MAX_ROWS", 1):
        out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=max_new_tokens)
    rounds, length = [], ids.shape[1] + 1  # the prefill commits one token before the first round
    for r in runs[-1].rounds:
        rounds.append((out[:, :length], r.draft_tokens, r.confidences))
        length += r.committed
    return out, rounds


def context(target, prefix, layer_ids):
    """The target's features of positions 0..L−2 of ``prefix`` [1, L] (the anchor is at L−1): [1, L−1, m·H]."""
    with torch.no_grad():
        hs = target(prefix, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)[:, : prefix.shape[1] - 1]


def check_rounds(target, drafter, peer_round, ids, max_new_tokens=24, min_commit=1):
    """Every drafting round of dspark's greedy generate() drafts what ``peer_round(prefix)`` drafts; the output is
    plain greedy's."""
    out, rounds = dspark_rounds(target, drafter, ids, max_new_tokens)
    plain = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
    assert torch.equal(out, plain)
    assert len(rounds) >= 3
    if min_commit > 1:  # some round committed several tokens (the drafter's context cache crops after it)
        lengths = [p.shape[1] for p, _, _ in rounds]
        assert max(b - a for a, b in zip(lengths, lengths[1:])) >= min_commit
    for prefix, tokens, confs in rounds:
        peer_tokens, peer_confs = peer_round(prefix)
        assert tokens == peer_tokens[: len(tokens)], f"round at length {prefix.shape[1]}"
        if peer_confs is None:
            assert confs == []
        else:
            torch.testing.assert_close(torch.tensor(confs), torch.tensor(peer_confs[: len(confs)]),
                                       rtol=1e-4, atol=1e-5)
    return rounds


def load_dspark(path, target):
    """The drafter in ``path`` (any format), as a user loads it."""
    return md.DSparkDraftModel.from_pretrained(path, target=target).eval()


# ---------------------------------------------------------------------------------------------------- z-lab DFlash
def zlab_round(model, target):
    """z-lab DFlash's drafting round (dflash/model.py `dflash_generate`) at a committed prefix, no cache."""
    def run(prefix):
        slots = model.block_size
        start = prefix.shape[1] - 1
        block = torch.full((1, slots), model.mask_token_id, dtype=torch.long)
        block[:, 0] = prefix[0, -1]
        scale = float(model.config.dflash_config.get("input_embedding_scale", 1.0))
        with torch.no_grad():
            noise = F.embedding(block, target.get_input_embeddings().weight) * scale
            hidden = model(target_hidden=context(target, prefix, model.target_layer_ids), noise_embedding=noise,
                           position_ids=torch.arange(start + slots)[None], past_key_values=None,
                           use_cache=False)[:, 1 - slots:, :]
            logits = model.compute_logits(hidden, target.get_output_embeddings())
        return logits.argmax(-1)[0].tolist(), None
    return run


@needs_dflash
@pytest.mark.parametrize("family,vocab", [("qwen3", VOCAB), ("llama", VOCAB), ("qwen3", SMALL_VOCAB)])
def test_zlab_dflash_checkpoint_drafts_as_dflash(tmp_path, family, vocab):
    from dflash.model import DFlashDraftModel

    target = tiny_target(family, vocab=vocab)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      layer_types=["full_attention"] * 2)
    cfg.architectures = ["DFlashDraftModel"]
    cfg.num_target_layers = 6
    cfg.block_size = 5
    cfg.dflash_config = {"mask_token_id": MASK if vocab > MASK else SMALL_MASK, "target_layer_ids": [0, 2, 4]}
    torch.manual_seed(3)
    peer = DFlashDraftModel(cfg).eval()
    scale_weights(peer, seed=3)
    peer.save_pretrained(tmp_path)
    assert formats.detect_format(json.loads((tmp_path / "config.json").read_text())) == "dflash"

    drafter = load_dspark(tmp_path, target)
    assert drafter.config.block_size == 4 and not drafter.config.anchor_predicts
    peer = DFlashDraftModel.from_pretrained(tmp_path).eval()
    check_rounds(target, drafter, zlab_round(peer, target), prompt(vocab=vocab), max_new_tokens=40,
                 min_commit=2 if vocab == SMALL_VOCAB else 1)


@needs_dflash
def test_dflash_export_loads_in_zlab_dflash(tmp_path):
    from dflash.model import DFlashDraftModel

    target = tiny_target("qwen3")
    cfg = md.DSparkConfig.from_target_config(
        target.config, block_size=4, num_draft_layers=2, target_layer_ids=[-1, 1, 3], mask_token_id=MASK,
        anchor_predicts=False, sequential_head="none", use_confidence_head=False, intermediate_size=96)
    drafter = md.DSparkDraftModel(cfg).eval()
    scale_weights(drafter, seed=5)
    drafter.bind_target(target)
    export.export_drafter(drafter, tmp_path / "out", format="dflash")
    peer = DFlashDraftModel.from_pretrained(tmp_path / "out").eval()
    assert peer.block_size == 5 and peer.target_layer_ids == [-1, 1, 3]
    check_rounds(target, drafter, zlab_round(peer, target), prompt(seed=2))


@needs_specforge
def test_dflash_export_loads_in_specforge(tmp_path):
    from specforge.modeling.draft.dflash import DFlashDraftModel

    target = tiny_target("llama")
    cfg = md.DSparkConfig.from_target_config(
        target.config, block_size=5, num_draft_layers=2, target_layer_ids=[0, 2, 4], mask_token_id=MASK,
        anchor_predicts=False, sequential_head="none", use_confidence_head=False, intermediate_size=96)
    drafter = md.DSparkDraftModel(cfg).eval()
    scale_weights(drafter, seed=8)
    drafter.bind_target(target)
    export.export_drafter(drafter, tmp_path / "out", format="dflash")
    peer = DFlashDraftModel.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    check_rounds(target, drafter, specforge_round(peer, target), prompt(seed=4))


# ---------------------------------------------------------------------------------------------------- SpecForge
def specforge_round(model, target):
    """SpecForge's drafting round (`DFlashDraftModel.spec_generate` / `DSparkDraftModel._sample_draft_tokens`) at a
    committed prefix, no cache; confidences from its `predict_confidence` (σ of the logit), None without the head."""
    def run(prefix):
        slots = model.block_size
        start = prefix.shape[1] - 1
        block = torch.full((1, slots), model.mask_token_id, dtype=torch.long)
        block[:, 0] = prefix[0, -1]
        with torch.no_grad():
            hidden = model(target_hidden=context(target, prefix, model.target_layer_ids),
                           noise_embedding=target.model.embed_tokens(block),
                           position_ids=torch.arange(start + slots)[None], is_causal=False)
            tokens = model._sample_draft_tokens(target, hidden, block)
            proposal = hidden[:, 1 - slots:, :]
            prev = torch.cat([block[:, :1], tokens[:, :-1]], dim=1)
            conf = model.predict_confidence(proposal, prev_token_ids=prev)
        return tokens[0].tolist(), None if conf is None else torch.sigmoid(conf)[0].tolist()
    return run


def specforge_config(projector: str, vocab: int = VOCAB, **dflash_config):
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      layer_types=["full_attention"] * 2)
    cfg.num_target_layers = 6
    cfg.block_size = 6
    cfg.dflash_config = {"mask_token_id": MASK if vocab > MASK else SMALL_MASK, "target_layer_ids": [1, 3],
                         **dflash_config}
    if projector == "dspark":
        cfg.dflash_config["projector_type"] = "dspark"
    cfg._attn_implementation = "eager"
    return cfg


@needs_specforge
@pytest.mark.parametrize("family,head,vocab", [
    ("qwen3", "vanilla", VOCAB), ("qwen3", "gated", VOCAB), ("qwen3", "rnn", VOCAB), ("llama", "vanilla", VOCAB),
    ("qwen3", "dflash", VOCAB), ("qwen3", "vanilla", SMALL_VOCAB),
])
def test_specforge_checkpoint_drafts_as_specforge(tmp_path, family, head, vocab):
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.modeling.draft.dspark import DSparkDraftModel

    target = tiny_target(family, vocab=vocab)
    if head == "dflash":
        cls, cfg = DFlashDraftModel, specforge_config("dflash", vocab)
    else:
        cls = DSparkDraftModel
        cfg = specforge_config("dspark", vocab, markov_rank=8, markov_head_type=head, enable_confidence_head=True,
                               confidence_head_with_markov=head != "gated", attention_mode="gqa")
    torch.manual_seed(4)
    peer = cls(cfg).eval()
    scale_weights(peer, seed=4)
    peer.save_pretrained(tmp_path)
    assert formats.detect_format(json.loads((tmp_path / "config.json").read_text())) == (
        "dflash" if head == "dflash" else "specforge")

    drafter = load_dspark(tmp_path, target)
    peer = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    rounds = check_rounds(target, drafter, specforge_round(peer, target),
                          prompt(seed=3 if vocab == VOCAB else 1, vocab=vocab),
                          max_new_tokens=40, min_commit=2 if vocab == SMALL_VOCAB else 1)
    if head != "dflash":
        assert rounds[0][2] and all(len(c) == len(t) for _, t, c in rounds)


# ---------------------------------------------------------------------------------------------------- speculators
def speculators_round(model, target):
    """speculators' own forward (`DFlashDraftModel._backbone_forward`: one anchor block attending to the context
    before it, its `lm_head`) plus its Markov head's `block_bias` and `confidence_head`, fed the drafted tokens
    left to right as its training forward feeds the true ones (`DSparkDraftModel.forward`); draft ids mapped to
    target ids with its d2t. ``sample_from_anchor``: slot k predicts anchor + k + 1 after block token k; otherwise
    slot k ≥ 1 predicts anchor + k after block token k − 1."""
    def run(prefix):
        slots, length = model.block_size, prefix.shape[1]
        ids = torch.cat([prefix, prefix.new_zeros(1, slots)], dim=1)  # positions after the anchor are never seen
        loss_mask = torch.zeros_like(ids)
        loss_mask[0, length - 1] = 1  # the one anchor: the last committed token
        with torch.no_grad():
            hs = target(ids, output_hidden_states=True).hidden_states
            feats = torch.cat([hs[i] for i in model.config.aux_hidden_state_layer_ids], dim=-1)
            hidden, logits, *_ = model._backbone_forward(
                feats, ids, loss_mask, torch.zeros(1, ids.shape[1], model.hidden_size), torch.zeros_like(ids),
                max_anchors=1)
            hidden, logits = hidden.view(1, slots, -1), logits.view(1, slots, -1)
            anchor_first = model.config.sample_from_anchor
            block, tokens = [int(prefix[0, -1])] + [0] * (slots - 1), []
            head = getattr(model, "markov_head", None)

            def prev_ids():
                b = torch.tensor([block])
                return b if anchor_first else torch.cat([b[:, :1], b[:, :-1]], dim=1)

            for s in range(0 if anchor_first else 1, slots):
                step = logits[0, s]
                if head is not None:
                    step = step + head.block_bias(prev_token_ids=prev_ids(), hidden_states=hidden)[0, s]
                col = int(step.argmax())
                token = col + int(model.d2t[col]) if model.d2t is not None else col
                tokens.append(token)
                if anchor_first and s + 1 < slots:
                    block[s + 1] = token
                elif not anchor_first:
                    block[s] = token
            conf = None
            if getattr(model, "confidence_head", None) is not None:
                feats = hidden
                if model.config.confidence_head_with_markov:
                    feats = torch.cat([hidden, head.prev_embeddings(prev_ids())], dim=-1)
                conf = torch.sigmoid(model.confidence_head(feats))[0, 0 if anchor_first else 1:].tolist()
        return tokens, conf
    return run


def speculators_peer(kind, target, verifier_dir, draft_vocab=None, **kwargs):
    """A speculators drafter made by its own `from_training_args` (verifier weights read from ``verifier_dir``)."""
    import copy

    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dspark import DSparkDraftModel

    layer_config = copy.deepcopy(target.config)
    layer_config.num_hidden_layers = 2
    t2d = d2t = None
    if draft_vocab:
        ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:draft_vocab].sort().values
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[ids] = True
        d2t = ids - torch.arange(draft_vocab)
    cls = DSparkDraftModel if kind == "dspark" else DFlashDraftModel
    model = cls.from_training_args(layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=str(verifier_dir),
                                   target_layer_ids=[1, 3], block_size=5, mask_token_id=MASK,
                                   draft_vocab_size=draft_vocab or VOCAB, draft_attn_impl="eager", **kwargs)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # weights of a larger scale; the frozen copies of the verifier's stay
        for name, p in model.named_parameters():
            if not name.startswith(("embed_tokens", "lm_head", "verifier_")):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                        else 0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


@needs_speculators
@pytest.mark.parametrize("family,kind,anchor,vocab,head,with_markov", [
    ("qwen3", "dspark", True, 40, "vanilla", True),
    ("llama", "dspark", True, None, "vanilla", False),
    ("qwen3", "dspark", False, None, "gated", False),
    ("qwen3", "dspark", True, None, "rnn", True),
    ("qwen3", "dflash", False, None, None, False),
])
def test_speculators_checkpoint_drafts_as_speculators(tmp_path, family, kind, anchor, vocab, head, with_markov):
    target = tiny_target(family)
    target.save_pretrained(tmp_path / "verifier")
    extra = dict(markov_rank=8, markov_head_type=head, confidence_head_with_markov=with_markov) if head else {}
    peer = speculators_peer(kind, target, tmp_path / "verifier", vocab, sample_from_anchor=anchor, **extra)
    peer.save_pretrained(tmp_path / "draft")
    assert formats.detect_format(json.loads((tmp_path / "draft" / "config.json").read_text())) == "speculators"
    drafter = load_dspark(tmp_path / "draft", target)
    assert drafter.config.anchor_predicts == anchor and drafter.config.draft_vocab_size == vocab
    check_rounds(target, drafter, speculators_round(peer, target), prompt(seed=3))


@needs_speculators
def test_speculators_rnn_without_anchor_slot_is_refused(tmp_path):
    """speculators' RNN head with sample_from_anchor=false steps its state through the anchor's slot (which
    predicts nothing), unlike SpecForge's and dspark's: refused rather than drafted differently."""
    target = tiny_target("qwen3")
    target.save_pretrained(tmp_path / "verifier")
    peer = speculators_peer("dspark", target, tmp_path / "verifier", sample_from_anchor=False, markov_rank=8,
                            markov_head_type="rnn")
    peer.save_pretrained(tmp_path / "draft")
    with pytest.raises(ValueError, match="RNN head with sample_from_anchor=false"):
        formats.load_config_and_state(tmp_path / "draft", target.config)


@needs_speculators
@pytest.mark.parametrize("anchor,vocab,heads", [(True, 40, True), (False, None, True), (False, None, False)])
def test_speculators_export_loads_in_speculators(tmp_path, monkeypatch, anchor, vocab, heads):
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    target = tiny_target("qwen3")
    target.save_pretrained(tmp_path / "verifier")
    extra = {} if heads else dict(sequential_head="none", use_confidence_head=False)
    cfg = md.DSparkConfig.from_target_config(
        target.config, block_size=4, num_draft_layers=2, target_layer_ids=[0, 2], mask_token_id=MASK, **extra,
        markov_rank=8, draft_vocab_size=vocab, anchor_predicts=anchor, intermediate_size=96,
        target_name_or_path=str(tmp_path / "verifier"),
        sts_temperatures=[1.5, 1.2, 1.1, 1.0], sts_biases=[0.1, 0, 0, -0.2])
    drafter = md.DSparkDraftModel(cfg).eval()
    scale_weights(drafter, seed=6)
    if vocab:
        drafter.draft_vocab_ids.copy_(torch.randperm(VOCAB)[:vocab].sort().values)
    drafter.bind_target(target)
    # exports name their verifier portably (an absolute path, as target_name_or_path above, is refused): here a path
    # relative to the directory speculators is run from
    out = export.export_drafter(drafter, tmp_path / "spec", format="speculators", verifier_name="verifier")
    monkeypatch.chdir(tmp_path)
    model_cls, config_cls = (DSparkDraftModel, DSparkSpeculatorConfig) if heads else (
        DFlashDraftModel, DFlashSpeculatorConfig)
    config = config_cls.model_validate(json.loads((out / "config.json").read_text()))
    assert config.sample_from_anchor == anchor and config.draft_vocab_size == (vocab or VOCAB)
    assert config.aux_hidden_state_layer_ids == [1, 3]

    config = config_cls.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"  # not flex attention (compiled) on CPU
    peer = model_cls.from_pretrained(out, config=config).eval()
    peer_round = speculators_round(peer, target)

    def calibrated(prefix):  # dspark reports c_k = σ(logit_k / T_k + b_k) with the drafter's STS
        tokens, conf = peer_round(prefix)
        if conf is None:
            return tokens, None
        logits = torch.logit(torch.tensor(conf, dtype=torch.float64))
        k = torch.arange(len(conf))
        temps, biases = torch.tensor(cfg.sts_temperatures).double(), torch.tensor(cfg.sts_biases).double()
        return tokens, torch.sigmoid(logits / temps[k] + biases[k]).tolist()

    check_rounds(target, drafter, calibrated, prompt(seed=2))
    back = load_dspark(out, target)  # and back: the same drafter, STS included
    assert back.config.sts_temperatures == cfg.sts_temperatures and back.config.sts_biases == cfg.sts_biases
    for key, value in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
