"""Interoperability with the real peer implementations (installed by scripts/install_peers.sh).

For z-lab DFlash (``dflash==0.1.0``), SpecForge (``specforge==0.2.0``) and vLLM speculators
(``speculators==0.9.0``): the peer's own code initialises a drafter for a tiny random target and saves it; dspark
loads the directory (:func:`modeling_dspark.formats.load_config_and_state`) and must draft, round by round, the
same tokens and confidences as the peer's own forward at the same committed prefix; greedy ``generate()`` with the
imported drafter equals plain greedy (fp32). The reverse: what ``export_drafter`` writes loads with the peer's
code and drafts the same. A peer that is not installed skips its tests (CI installs them).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import modeling_dspark as md
from generation import enable_dspark
from generation.integration import dspark_options
from generation.stats import collect_stats
from modeling_dspark import formats

pytestmark = pytest.mark.usefixtures("one_thread")

MASK = 7  # the mask token id the peers' drafters use (a real id of the tiny vocabulary)
VOCAB = 160


def _requires(module: str):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None,
        reason=f"peer package {module!r} is not installed (scripts/install_peers.sh installs it; CI runs these)",
    )


needs_dflash = _requires("dflash")
needs_specforge = _requires("specforge")
needs_speculators = _requires("speculators")


def tiny_target(family: str = "qwen3", seed: int = 0):
    """A tiny random target (fp32, eager attention) with 6 layers."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=None,
                 pad_token_id=None, bos_token_id=None)
    if family == "qwen3":
        target = Qwen3ForCausalLM(Qwen3Config(**shape))
    else:
        target = LlamaForCausalLM(LlamaConfig(**shape, rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    target.config._attn_implementation = "eager"
    return enable_dspark(target.eval())


def prompt(seed: int = 1, length: int = 9) -> torch.LongTensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, VOCAB, (1, length), generator=g)


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
    with collect_stats() as runs, dspark_options(policy="full"):
        out = target.generate(ids, assistant_model=drafter, do_sample=False, max_new_tokens=max_new_tokens)
    rounds, length = [], ids.shape[1] + 1  # the prefill commits one token before the first round
    for r in runs[-1].rounds:
        rounds.append((out[:, :length], r.draft_tokens, r.confidences))
        length += r.committed
    return out, rounds


def context(target, prefix, layer_ids):
    """The target's features of positions 0..L−2 of ``prefix`` [1, L] (the anchor is at L−1): ``[1, L−1, m·H]``."""
    with torch.no_grad():
        hs = target(prefix, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)[:, : prefix.shape[1] - 1]


def check_rounds(target, drafter, peer_round, ids, max_new_tokens=24):
    """Every drafting round of dspark's greedy generate() drafts what ``peer_round(prefix)`` drafts; the output is
    plain greedy's."""
    out, rounds = dspark_rounds(target, drafter, ids, max_new_tokens)
    plain = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
    assert torch.equal(out, plain)
    assert len(rounds) >= 3
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
    config, state = formats.load_config_and_state(path, target.config)
    drafter = md.DSparkDraftModel(config)
    drafter.load_state_dict(state, strict=True)
    return drafter.eval().bind_target(target)


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
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_zlab_dflash_checkpoint_drafts_as_dflash(tmp_path, family):
    from dflash.model import DFlashDraftModel

    target = tiny_target(family)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      layer_types=["full_attention"] * 2)
    cfg.architectures = ["DFlashDraftModel"]
    cfg.num_target_layers = 6
    cfg.block_size = 5
    cfg.dflash_config = {"mask_token_id": MASK, "target_layer_ids": [0, 2, 4]}
    torch.manual_seed(3)
    peer = DFlashDraftModel(cfg).eval()
    scale_weights(peer, seed=3)
    peer.save_pretrained(tmp_path)
    assert formats.detect_format(json.loads((tmp_path / "config.json").read_text())) == "dflash"

    drafter = load_dspark(tmp_path, target)
    assert drafter.config.block_size == 4 and not drafter.config.anchor_predicts
    peer = DFlashDraftModel.from_pretrained(tmp_path).eval()
    check_rounds(target, drafter, zlab_round(peer, target), prompt())


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
    formats.export_drafter(drafter, tmp_path / "out", format="dflash")
    peer = DFlashDraftModel.from_pretrained(tmp_path / "out").eval()
    assert peer.block_size == 5 and peer.target_layer_ids == [-1, 1, 3]
    check_rounds(target, drafter, zlab_round(peer, target), prompt(seed=2))


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


def specforge_config(projector: str, **dflash_config):
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      layer_types=["full_attention"] * 2)
    cfg.num_target_layers = 6
    cfg.block_size = 6
    cfg.dflash_config = {"mask_token_id": MASK, "target_layer_ids": [1, 3], **dflash_config}
    if projector == "dspark":
        cfg.dflash_config["projector_type"] = "dspark"
    cfg._attn_implementation = "eager"
    return cfg


@needs_specforge
@pytest.mark.parametrize(
    "family,head",
    [("qwen3", "vanilla"), ("qwen3", "gated"), ("qwen3", "rnn"), ("llama", "vanilla"), ("qwen3", "dflash")],
)
def test_specforge_checkpoint_drafts_as_specforge(tmp_path, family, head):
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.modeling.draft.dspark import DSparkDraftModel

    target = tiny_target(family)
    if head == "dflash":
        cls, cfg = DFlashDraftModel, specforge_config("dflash")
    else:
        cls = DSparkDraftModel
        cfg = specforge_config("dspark", markov_rank=8, markov_head_type=head, enable_confidence_head=True,
                               confidence_head_with_markov=head != "gated", attention_mode="gqa")
    torch.manual_seed(4)
    peer = cls(cfg).eval()
    scale_weights(peer, seed=4)
    peer.save_pretrained(tmp_path)
    assert formats.detect_format(json.loads((tmp_path / "config.json").read_text())) == (
        "dflash" if head == "dflash" else "specforge")

    drafter = load_dspark(tmp_path, target)
    peer = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    rounds = check_rounds(target, drafter, specforge_round(peer, target), prompt(seed=3))
    if head != "dflash":
        assert rounds[0][2] and all(len(c) == len(t) for _, t, c in rounds)


# ---------------------------------------------------------------------------------------------------- speculators
@needs_speculators
def test_speculators_export_validates_with_speculators(tmp_path):
    from speculators.models.dspark import DSparkSpeculatorConfig

    target = tiny_target("qwen3")
    cfg = md.DSparkConfig.from_target_config(
        target.config, block_size=4, num_draft_layers=1, target_layer_ids=[0, 2], mask_token_id=MASK,
        markov_rank=8, draft_vocab_size=40, sts_temperatures=[1.5, 1.2, 1.1, 1.0], sts_biases=[0.1, 0, 0, -0.2])
    drafter = md.DSparkDraftModel(cfg).eval()
    scale_weights(drafter, seed=6)
    drafter.draft_vocab_ids.copy_(torch.randperm(VOCAB)[:40].sort().values)
    drafter.bind_target(target)
    out = formats.export_drafter(drafter, tmp_path / "spec", format="speculators")
    config = json.loads((out / "config.json").read_text())
    peer = DSparkSpeculatorConfig.model_validate(config)
    assert peer.block_size == 4 and peer.sample_from_anchor and peer.draft_vocab_size == 40
    assert peer.aux_hidden_state_layer_ids == [1, 3]

    back = load_dspark(out, target)
    assert back.config.sts_temperatures == cfg.sts_temperatures and back.config.sts_biases == cfg.sts_biases
    assert torch.equal(back.draft_vocab_ids, drafter.draft_vocab_ids)
    for key, value in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
