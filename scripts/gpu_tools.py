#!/usr/bin/env python3
"""Helpers of scripts/gpu_check.sh and scripts/gpu_drafter.sh (docs/gpu.md).

    tiny DIR                 a tiny random Llama target with a character tokenizer and chat template (DIR/target),
                             and a random DSpark drafter for it (DIR/drafter): the --dry-run stand-ins, made in ~1 s
    lossless --out F.json    the lossless checks on --device: greedy generate() with the drafter token for token
                             against plain greedy (float32 must be identical; bfloat16 is counted, since a batched
                             verify may round differently at a near-tie), seeded sampling end to end, and the engine at
                             R > 1 against plain greedy per request (float32); where greedy outputs part, the
                             target's top-1 minus top-2 logit there (a near-tie or not); written after each dtype
    calib-prompts --out F   held-out calibration prompts as JSON lines (`dspark calibrate --prompts F`), made where the
                             data packages are installed, excluding the prompts of --exclude-data builds
    summary --out F.json     gather the step results of one run (JSON files) into one small file with a markdown digest
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def make_tiny(out: Path) -> dict:
    """Tiny random target (vocab = characters + specials, 2 layers) saved with its tokenizer, and a drafter."""
    import torch
    from tokenizers import Tokenizer, models, normalizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    import modeling_dspark as md

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 .,?!:;'\"()[]{}+-*/=_<>\n")
    specials = ["<pad>", "<bos>", "<eos>", "<unk>", "<u>", "<a>"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.normalizer = normalizers.Lowercase()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                  unk_token="<unk>", additional_special_tokens=["<u>", "<a>"])
    tok.chat_template = ("{% for m in messages %}<u>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<a>{% endif %}")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        target.get_input_embeddings().weight.mul_(4.0)  # peaked: greedy continuations vary
    target.generation_config.eos_token_id, target.generation_config.pad_token_id = 2, 0
    target.save_pretrained(out / "target")
    tok.save_pretrained(out / "target")
    torch.manual_seed(1)
    dcfg = md.DSparkConfig.from_target_config(target.config, block_size=4, markov_rank=8, mask_token_id=3)
    md.DSparkDraftModel(dcfg).save_pretrained(out / "drafter")
    return {"target": str(out / "target"), "drafter": str(out / "drafter")}


def top2_margin(target, ids, tokens: list[int]) -> float:
    """The target's top-1 minus top-2 logit after ``ids`` (1, L) and ``tokens``: how near a tie the step is where two
    greedy outputs part (a batched verify and a one-token step may round differently only at a near-tie)."""
    import torch

    x = torch.cat([ids, torch.tensor([tokens], dtype=ids.dtype, device=ids.device)], dim=1)
    with torch.no_grad():
        top = target(x).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def _passed(out: dict) -> bool:
    """Every requested dtype checked, float32 greedy and engine outputs identical to plain, every sampled token in
    the vocabulary."""
    f32 = out["dtypes"].get("float32")
    return out["complete"] and bool(f32) and f32["greedy_identical"] == f32["greedy_prompts"] and \
        f32.get("engine_identical") == f32.get("engine_requests") and \
        all(r["sampling_tokens_in_vocab"] for r in out["dtypes"].values())


def lossless(args, save) -> dict:
    """The checks of the module doc per dtype; ``save(result)`` after each dtype (a time limit keeps what ran)."""
    import torch
    from transformers.utils import logging as hf_logging

    from benchmarks.common import load_domain_prompts
    from dspark.evaluation.eval_sets import timed_generate
    from dspark.generation import DSparkEngine
    from dspark.pairing import load_models
    from modeling_dspark.target import apply_chat_template, shipped_drafter_for

    hf_logging.disable_progress_bar()
    drafter_spec = args.drafter or str(shipped_drafter_for(args.target))
    prompts = [p for ps in load_domain_prompts(args.per_domain, 0).values() for p in ps]
    out = {"device": args.device, "target": args.target, "drafter": drafter_spec, "torch": torch.__version__,
           "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "dtypes": {}}
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(args.device)
    for dt in args.dtypes.split(","):
        t0 = time.perf_counter()
        target, tok, drafter = load_models(args.target, drafter_spec, dt, args.device)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        gen = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": pad}
        enc = [apply_chat_template(tok, p["prompt"]) for p in prompts]
        ids = [torch.tensor([e], device=target.device) for e in enc]
        plain = [timed_generate(target, x, None, gen)[0] for x in ids]
        greedy = [timed_generate(target, x, drafter, gen) for x in ids]
        same = [g[0] == p for g, p in zip(greedy, plain)]
        differ = [(x, p, next((i for i, (a, b) in enumerate(zip(g[0], p)) if a != b), min(len(g[0]), len(p))))
                  for x, g, p in zip(ids, greedy, plain) if g[0] != p]  # (prompt, plain output, first difference)
        first_diff = [i for _, _, i in differ]
        sample = dict(gen, do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
        sampled = [timed_generate(target, x, drafter, sample, seed=i) for i, x in enumerate(ids)]
        vocab = target.config.vocab_size
        margins = [top2_margin(target, x, p[:i]) for x, p, i in differ]
        row = {"greedy_identical": sum(same), "greedy_prompts": len(same), "greedy_first_difference": first_diff,
               "greedy_first_difference_top2_margin": margins,
               "greedy_tau": sum(g[2].tau for g in greedy if g[2]) / max(1, sum(1 for g in greedy if g[2])),
               "sampling_ran": len(sampled), "sampling_tokens": sum(len(s[0]) for s in sampled),
               "sampling_tokens_in_vocab": all(0 <= t < vocab for s in sampled for t in s[0]),
               "sampling_tau": sum(s[2].tau for s in sampled if s[2]) / max(1, sum(1 for s in sampled if s[2]))}
        if dt == "float32":  # the engine at R > 1 against plain greedy, request by request
            engine = DSparkEngine(target, drafter, max_batch_size=args.engine_r)
            n = [max(2, args.max_new_tokens // 2 + (7 * i) % (args.max_new_tokens // 2 + 1)) for i in range(len(enc))]
            rid = [engine.add_request(e, k) for e, k in zip(enc, n)]
            outs = {o.request_id: o.output_ids for o in engine.run()}
            ref = [timed_generate(target, x, None, dict(gen, max_new_tokens=k))[0] for x, k in zip(ids, n)]
            row["engine_r"] = args.engine_r
            row["engine_identical"] = sum(outs[r] == p for r, p in zip(rid, ref))
            row["engine_requests"] = len(rid)
        row["seconds"] = time.perf_counter() - t0
        out["dtypes"][dt] = row
        out["complete"] = set(out["dtypes"]) == set(args.dtypes.split(","))
        out["pass"] = _passed(out)
        save(out)
        print(f"[lossless] {dt}: {json.dumps(row)}", file=sys.stderr, flush=True)
        del target, drafter
    return out


def calib_prompts(args) -> int:
    from dspark.training.heldout import calibration_prompts

    recs, _ = calibration_prompts(limit=args.limit, exclude_data=args.exclude_data)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps({"id": str(r["id"]), "prompt": r["prompt"]}) + "\n")
    print(f"{len(recs)} calibration prompts written to {args.out}", file=sys.stderr)
    return 0


def summary(args) -> dict:
    """One small JSON of every step's result file in --dir, plus their markdown tables."""
    out = {"steps": {}, "markdown": []}
    for f in sorted(Path(args.dir).glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except ValueError as err:  # recorded, so the other steps' results still come back
            out["steps"][f.stem] = {"unreadable": str(err)}
            continue
        for run in data.get("runs", []):  # keep per-domain aggregates, drop per-prompt records (size)
            for part in (run.get("generate"), run):
                if isinstance(part, dict):
                    part.pop("per_prompt", None)
        out["steps"][f.stem] = data
        if data.get("markdown"):
            out["markdown"].append(f"### {f.stem}\n\n{data['markdown']}")
    log = Path(args.dir) / "steps.log"
    if log.exists():
        out["step_status"] = log.read_text().splitlines()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("tiny")
    s.add_argument("dir")
    s = sub.add_parser("lossless")
    s.add_argument("--target", default="SmolLM2-135M-Instruct")
    s.add_argument("--drafter", default=None)
    s.add_argument("--device", default="cuda")
    s.add_argument("--dtypes", default="float32,bfloat16")
    s.add_argument("--per-domain", type=int, default=2)
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--engine-r", type=int, default=4)
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--out", required=True)
    s = sub.add_parser("calib-prompts")
    s.add_argument("--limit", type=int, default=256)
    s.add_argument("--exclude-data", action="append", default=[])
    s.add_argument("--out", required=True)
    s = sub.add_parser("summary")
    s.add_argument("--dir", required=True)
    s.add_argument("--out", required=True)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.cmd == "tiny":
        print(json.dumps(make_tiny(Path(args.dir))))
        return 0
    if args.cmd == "calib-prompts":
        return calib_prompts(args)
    if args.cmd == "lossless":
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
    from benchmarks.common import write_json

    def save(result):
        write_json(result, args.out, indent=1)

    result = lossless(args, save) if args.cmd == "lossless" else summary(args)
    save(result)
    return 0 if result.get("pass", True) else 1


if __name__ == "__main__":
    sys.exit(main())
