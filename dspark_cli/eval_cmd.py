"""`dspark eval`: acceptance length, per-position acceptance and wall-clock speedup on held-out eval sets.

    dspark eval                                              # shipped drafter, gsm8k,humaneval,mtbench, all prompts
    dspark eval --limit 10 --max-new-tokens 64 --sets gsm8k --modes greedy
    dspark eval --drafter DIR --dtype float32 --out-dir runs/eval-fp32    # also checks greedy losslessness

For every eval set (``prompts.load_eval_prompts``; chat template applied) and prompt:

* **greedy** — ``target.generate(ids, assistant_model=drafter)`` (full-block verify policy unless ``--policy``) and,
  unless ``--no-speed``, plain ``target.generate(ids)`` and transformers' built-in prompt-lookup decoding
  (``prompt_lookup_num_tokens``) on the same prompt, interleaved per prompt (their order rotates from prompt to
  prompt) after one warm-up call of each. Speedup = DSpark tokens/s ÷ plain tokens/s over the whole set. Greedy
  DSpark output is compared with plain output token for token (in float32 it must be identical: exit code 1
  otherwise; in bfloat16 the number of identical outputs is reported).
* **sample** — the same with T = 1 sampling (seed + prompt index), for τ.

Reported per set and mode: τ = committed tokens / speculative rounds (the paper's acceptance length; the prefill
is not a round), ``tokens_per_target_forward`` = new tokens / target forward calls counted with a forward hook (the
τ-equivalent used for the prompt-lookup row; it includes the prefill), the conditional acceptance rate of each
position k (P(x_k accepted | x_<k accepted)), the survival P(x_1..x_k accepted) and the implied τ for block size k
(1 + Σ_{j≤k} survival_j).

Writes ``eval.json``, ``eval.md`` (markdown tables) and ``tau_per_position.png`` into ``--out-dir``.
Exit codes: 0 success, 1 a float32 greedy output differed from plain generate(), 2 usage or input error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from .calibrate_cmd import acceptance_matrix, eos_token_ids

from .common import (
    CLIError,
    REPO_ROOT,
    SHIPPED_DRAFTER,
    # noqa: F401,
    add_device_option,
    add_dtype_option,
    add_out_dir_option,
    add_progress_option,
    add_threads_option,
    check_min,
    check_target,
    drafter_dir,
    load_drafter,
    load_target_checked,
    reports_cli_errors,
    resolve_device,
    resolve_dtype,
    set_threads,
    shipped_drafter_for,
)

DEFAULT_SETS = "gsm8k,humaneval,mtbench"
MODES = ("greedy", "sample")
MIN_SPEED_PROMPTS = 8
"""Speed-ups from fewer prompts (each timed once) are marked as noise: load and warm-up decide them."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval",
        help="acceptance length, per-position acceptance and speedup on held-out eval sets",
        description=(
            "Evaluate a DSpark drafter on held-out eval sets: acceptance length tau (greedy and T=1), per-position "
            "conditional acceptance, wall-clock speedup over plain generate() and a prompt-lookup peer row. "
            "Writes eval.json, eval.md and tau_per_position.png."
        ),
    )
    p.add_argument("--drafter", default=None, metavar="PATH|HUB_ID|random",
                   help="DSpark drafter directory, Hugging Face Hub id or 'random' (default: "
                        f"{SHIPPED_DRAFTER.relative_to(REPO_ROOT)} "
                        "if present, else random)")
    p.add_argument("--target", default=None, metavar="PATH",
                   help="local transformers checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--sets", default=DEFAULT_SETS,
                   help=f"comma-separated eval sets among gsm8k, humaneval, mtbench, alpaca, arena-hard "
                        f"(default: {DEFAULT_SETS})")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each set (default: all)")
    p.add_argument("--block-size", type=int, default=None,
                   help="draft slots per round, 1..the drafter's block size (default: the drafter's)")
    p.add_argument("--policy", default="full", metavar="POLICY",
                   help="verify policy: none, full, fixed:N, threshold:P, scheduler or lagged[:LAG]; scheduler "
                        "profiles SPS(B) on first use (default: full)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most new tokens per prompt (default: 128)")
    p.add_argument("--modes", default="greedy,sample", help="comma-separated: greedy, sample (default: both)")
    add_dtype_option(p)
    add_device_option(p)
    add_threads_option(p)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per prompt: seed + index; default: 0)")
    p.add_argument("--pld-num-tokens", type=int, default=10,
                   help="prompt_lookup_num_tokens of the prompt-lookup peer row (default: 10)")
    p.add_argument("--no-pld", action="store_true", help="skip the prompt-lookup peer row")
    p.add_argument("--no-speed", action="store_true",
                   help="skip plain generate() and prompt lookup (tau only; no speedup, no identity check)")
    add_out_dir_option(p, "runs/eval", "where eval.json, eval.md and the plot are written")
    add_progress_option(p)
    p.set_defaults(func=run)
    return p


# ---------------------------------------------------------------------------------------------- helpers
def _resolve_drafter(spec: str | None, target: str | None) -> str:
    """``--drafter``: a drafter directory (:func:`drafter_dir`), ``"random"``, or for None the shipped drafter when
    ``target`` is the default target (else random)."""
    if spec is None:
        return shipped_drafter_for(target) or "random"
    if spec == "random":
        return spec
    return drafter_dir(spec)


def _check_args(args) -> tuple[list[str], list[str]]:
    from training.prompts import EVAL_SETS

    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    bad = [s for s in sets if s not in EVAL_SETS]
    if not sets or bad:
        raise CLIError(f"--sets: unknown eval set(s) {bad or sets}; choose from {', '.join(EVAL_SETS)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise CLIError(f"--modes must be a comma-separated subset of {', '.join(MODES)}, got {args.modes!r}")
    check_min(args, {"max_new_tokens": 1, "pld_num_tokens": 1, "limit": 1, "block_size": 1})
    check_target(args.target)
    from generation.policies import parse_policy

    try:
        args.policy = parse_policy(args.policy).name
    except ValueError as err:
        raise CLIError(f"--policy: {err}") from None
    return sets, modes


class ForwardCounter:
    """Counts forward calls of a module (here: the target) with a forward hook."""

    def __init__(self, module):
        self.n = 0
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1

    def remove(self):
        self._handle.remove()


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def run_one(target, ids, kind: str, gen_kwargs: dict, counter: ForwardCounter, drafter=None, seed=None,
            block_size=None, policy="full") -> dict:
    """One generate() call of ``kind`` ("plain", "dspark" or "pld"): new ids, seconds, forwards, rounds."""
    import torch

    from generation import collect_stats, dspark_options

    if seed is not None:
        torch.manual_seed(seed)
    kw = dict(gen_kwargs)
    pld_tokens = kw.pop("_pld_num_tokens", None)
    if kind == "pld":
        kw["prompt_lookup_num_tokens"] = pld_tokens
    mask = torch.ones_like(ids)
    runs: list = []
    with torch.inference_mode():
        _sync(ids.device)
        n0 = counter.n
        if kind == "dspark":
            # the drafter alone (no lookup proposer): τ and the per-position acceptance are the drafter's
            with collect_stats() as runs, dspark_options(policy=policy, block_size=block_size, lookup=False):
                t0 = time.perf_counter()
                out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **kw)
                _sync(ids.device)
                dt = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            out = target.generate(ids, attention_mask=mask, **kw)
            _sync(ids.device)
            dt = time.perf_counter() - t0
    return {"ids": out[0, ids.shape[1]:].tolist(), "seconds": dt, "forwards": counter.n - n0,
            "rounds": runs[-1].rounds if runs else None}


def per_position(acc, valid) -> dict:
    """Conditional acceptance rate, survival and implied τ per position from ``acceptance_matrix`` rows."""
    import numpy as np

    ok = np.logical_and.accumulate(valid, axis=1) if valid.size else valid
    gamma = acc.shape[1]
    cond, n_cond, surv, n_valid = [], [], [], []
    for k in range(gamma):
        rows = ok[:, k]
        c = rows & (acc[:, k - 1] == 1) if k > 0 else rows
        n_cond.append(int(c.sum()))
        cond.append(float(acc[c, k].mean()) if c.any() else None)
        n_valid.append(int(rows.sum()))
        surv.append(float(acc[rows, k].mean()) if rows.any() else None)
    implied, t = [], 1.0
    for s in surv:
        t += s or 0.0
        implied.append(t)
    return {"conditional_accept_rate": cond, "n_conditional": n_cond, "survival": surv, "n_valid": n_valid,
            "implied_tau_at_block_size": implied}


def _summarise_dspark(records: list[dict], gamma: int, eos: list[int]) -> dict:
    import numpy as np

    accs, valids = [], []
    committed = rounds = 0
    for r in records:
        rs = r["rounds"] or []
        hit = bool(r["ids"]) and r["ids"][-1] in eos and sum(x.committed for x in rs) + 1 == len(r["ids"])
        a, v = acceptance_matrix(rs, gamma, eos, hit)
        accs.append(a)
        valids.append(v)
        committed += sum(x.committed for x in rs)
        rounds += len(rs)
    acc = np.concatenate(accs) if accs else np.zeros((0, gamma), dtype=np.int8)
    valid = np.concatenate(valids) if valids else np.zeros((0, gamma), dtype=bool)
    out = _summarise_speed(records)
    taus = [sum(x.committed for x in r["rounds"]) / len(r["rounds"]) for r in records if r["rounds"]]
    out.update(rounds=rounds, tau=committed / rounds if rounds else None,
               tau_mean_per_prompt=float(np.mean(taus)) if taus else None,
               drafted=int(sum(x.drafted for r in records for x in (r["rounds"] or []))),
               accepted=int(sum(x.accepted for r in records for x in (r["rounds"] or []))),
               t_draft_ms=_mean([x.t_draft_ms for r in records for x in (r["rounds"] or [])]),
               t_verify_ms=_mean([x.t_verify_ms for r in records for x in (r["rounds"] or [])]),
               per_position=per_position(acc, valid))
    return out


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _summarise_speed(records: list[dict]) -> dict:
    tokens = sum(len(r["ids"]) for r in records)
    secs = sum(r["seconds"] for r in records)
    fwd = sum(r["forwards"] for r in records)
    return {"n_prompts": len(records), "new_tokens": tokens, "seconds": secs,
            "tokens_per_s": tokens / secs if secs > 0 else None, "target_forwards": fwd,
            "tokens_per_target_forward": tokens / fwd if fwd else None}


def _ratio(a, b):
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------------------------- evaluation
def evaluate(target, tok, drafter, sets: list[str], modes: list[str], limit=None, block_size=None, policy="full",
             max_new_tokens=128, seed=0, speed=True, pld=True, pld_num_tokens=10, progress=False) -> dict:
    """Run the evaluation (see the module doc) and return the ``results``/``summary`` part of eval.json."""
    import torch
    from tqdm.auto import tqdm

    from training.prompts import load_eval_prompts
    from modeling_dspark.target import apply_chat_template

    gamma = block_size or drafter.config.block_size
    eos = eos_token_ids(target, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else None)
    greedy_kw = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": pad,
                 "_pld_num_tokens": pld_num_tokens}
    sample_kw = dict(greedy_kw, do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    counter = ForwardCounter(target)
    dev = target.device
    data = {name: [torch.tensor([apply_chat_template(tok, p["prompt"])], device=dev)
                   for p in load_eval_prompts(name, limit)] for name in sets}
    results: dict = {}
    try:
        first = next(x for xs in data.values() for x in xs)
        warm = dict(greedy_kw, max_new_tokens=min(8, max_new_tokens))
        for kind in (["plain", "dspark"] + (["pld"] if pld else [])) if speed else ["dspark"]:
            run_one(target, first, kind, warm, counter, drafter, None, block_size, policy)
        if "sample" in modes:
            run_one(target, first, "dspark", dict(sample_kw, max_new_tokens=min(8, max_new_tokens)), counter,
                    drafter, seed, block_size, policy)

        for name in sets:
            prompts = data[name]
            res: dict = {"n_prompts": len(prompts)}
            bar = tqdm(total=len(prompts) * len(modes), desc=f"eval {name}", disable=not progress, file=sys.stderr)
            if "greedy" in modes:
                recs = {"dspark": [], "plain": [], "pld": []}
                kinds = ["dspark"] + (["plain"] + (["pld"] if pld else []) if speed else [])
                for i, ids in enumerate(prompts):
                    order = kinds[i % len(kinds):] + kinds[: i % len(kinds)]  # rotate to interleave fairly
                    for kind in order:
                        recs[kind].append(run_one(target, ids, kind, greedy_kw, counter, drafter, None,
                                                  block_size, policy))
                    bar.update(1)
                g = _summarise_dspark(recs["dspark"], gamma, eos)
                if speed:
                    base = _summarise_speed(recs["plain"])
                    same = [d["ids"] == b["ids"] for d, b in zip(recs["dspark"], recs["plain"])]
                    g.update(speedup=_ratio(g["tokens_per_s"], base["tokens_per_s"]),
                             n_identical=sum(same), all_identical=all(same),
                             differing_prompts=[i for i, s in enumerate(same) if not s])
                    res["plain"] = base
                    if pld:
                        p = _summarise_speed(recs["pld"])
                        same_p = [d["ids"] == b["ids"] for d, b in zip(recs["pld"], recs["plain"])]
                        p.update(speedup=_ratio(p["tokens_per_s"], base["tokens_per_s"]), n_identical=sum(same_p),
                                 num_tokens=pld_num_tokens)
                        res["prompt_lookup"] = p
                res["greedy"] = g
            if "sample" in modes:
                recs_s = []
                for i, ids in enumerate(prompts):
                    recs_s.append(run_one(target, ids, "dspark", sample_kw, counter, drafter, seed + i,
                                          block_size, policy))
                    bar.update(1)
                res["sample"] = _summarise_dspark(recs_s, gamma, eos)
            bar.close()
            results[name] = res
    finally:
        counter.remove()
    return {"results": results, "summary": _overall(results, modes)}


def _overall(results: dict, modes: list[str]) -> dict:
    out: dict = {}
    for mode in modes:
        taus = [r[mode]["tau"] for r in results.values() if r.get(mode) and r[mode]["tau"] is not None]
        out[f"tau_{mode}_macro"] = sum(taus) / len(taus) if taus else None
    for row, key in (("greedy", "dspark"), ("plain", "plain"), ("prompt_lookup", "prompt_lookup")):
        rs = [r[row] for r in results.values() if row in r]
        if rs:
            tokens, secs = sum(r["new_tokens"] for r in rs), sum(r["seconds"] for r in rs)
            out[f"{key}_tokens_per_s"] = tokens / secs if secs > 0 else None
    if "plain_tokens_per_s" in out:
        out["speedup"] = _ratio(out.get("dspark_tokens_per_s"), out["plain_tokens_per_s"])
        out["prompt_lookup_speedup"] = _ratio(out.get("prompt_lookup_tokens_per_s"), out["plain_tokens_per_s"])
        g = [r["greedy"] for r in results.values() if "greedy" in r]
        out["n_identical"] = sum(x["n_identical"] for x in g)
        out["n_compared"] = sum(x["n_prompts"] for x in g)
        out["speedup_is_noise"] = out["n_compared"] < MIN_SPEED_PROMPTS
    return out


# ---------------------------------------------------------------------------------------------- outputs
def _f(v, fmt="{:.2f}"):
    return fmt.format(v) if v is not None else "–"


def _speedup(v, n_prompts: int) -> str:
    """A speed-up cell; marked "(noise)" when measured on fewer than :data:`MIN_SPEED_PROMPTS` prompts."""
    return _f(v, "{:.2f}×") + (" (noise)" if v is not None and n_prompts < MIN_SPEED_PROMPTS else "")


def markdown(report: dict) -> str:
    cfg, results, summ = report["config"], report["results"], report["summary"]
    lines = [
        f"# dspark eval: {cfg['drafter']} on {cfg['target']}",
        "",
        f"{cfg['dtype']}, {cfg['device']}, block size {cfg['block_size']}, policy {cfg['policy']}, "
        f"max {cfg['max_new_tokens']} new tokens, limit {cfg['limit'] or 'all'} per set, "
        f"{cfg['machine']['torch_threads']} CPU threads.",
        "",
        "τ = committed tokens per speculative round; tok/fwd = new tokens per target forward (incl. prefill); "
        "speedup = tokens/s over plain `generate()` in the same run (greedy).",
        "",
        "| set | n | τ greedy | τ T=1 | tok/fwd | DSpark tok/s | plain tok/s | speedup | identical | "
        "PLD tok/fwd | PLD speedup |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        g, s, b, p = r.get("greedy", {}), r.get("sample", {}), r.get("plain", {}), r.get("prompt_lookup", {})
        ident = f"{g['n_identical']}/{g['n_prompts']}" if "n_identical" in g else "–"
        lines.append(
            f"| {name} | {r['n_prompts']} | {_f(g.get('tau'))} | {_f(s.get('tau'))} | "
            f"{_f(g.get('tokens_per_target_forward'))} | {_f(g.get('tokens_per_s'), '{:.1f}')} | "
            f"{_f(b.get('tokens_per_s'), '{:.1f}')} | {_speedup(g.get('speedup'), r['n_prompts'])} | {ident} | "
            f"{_f(p.get('tokens_per_target_forward'))} | {_speedup(p.get('speedup'), r['n_prompts'])} |"
        )
    macro = " ".join(f"τ {m} (macro) {_f(summ.get(f'tau_{m}_macro'))};" for m in ("greedy", "sample")
                     if f"tau_{m}_macro" in summ)
    n_all = summ.get("n_compared", 0)
    lines += ["", f"Overall: {macro} speedup {_speedup(summ.get('speedup'), n_all)}, "
                  f"prompt lookup {_speedup(summ.get('prompt_lookup_speedup'), n_all)}.", ""]
    if any(r["n_prompts"] < MIN_SPEED_PROMPTS for r in results.values()) and "speedup" in summ:
        lines += [f"(noise): a speed-up from fewer than {MIN_SPEED_PROMPTS} prompts, each timed once, is decided by "
                  f"other load and warm-up, not by the drafter; use --limit {MIN_SPEED_PROMPTS} or more to measure "
                  "speed.", ""]
    gamma = cfg["block_size"]
    lines += ["Conditional acceptance rate P(x_k accepted | x_<k accepted):", "",
              "| set | mode | " + " | ".join(f"k={k}" for k in range(1, gamma + 1)) + " |",
              "|---|---|" + "---:|" * gamma]
    for name, r in results.items():
        for mode in MODES:
            if mode in r:
                pp = r[mode]["per_position"]["conditional_accept_rate"]
                lines.append(f"| {name} | {mode} | " + " | ".join(_f(v) for v in pp) + " |")
    lines += ["", f"Command: `{cfg['command']}`", ""]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> Path:
    """Two panels: conditional acceptance rate per position; implied τ for block size k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, r) in enumerate(report["results"].items()):
        for mode, ls in (("greedy", "-"), ("sample", "--")):
            if mode not in r:
                continue
            pp = r[mode]["per_position"]
            ks = list(range(1, len(pp["survival"]) + 1))
            cond = [v if v is not None else float("nan") for v in pp["conditional_accept_rate"]]
            c = colors[i % len(colors)]
            ax1.plot(ks, cond, ls, marker="o", ms=3, color=c, label=f"{name} ({'T=1' if mode == 'sample' else mode})")
            ax2.plot([0] + ks, [1.0] + pp["implied_tau_at_block_size"], ls, marker="o", ms=3, color=c,
                     label=f"{name} ({'T=1' if mode == 'sample' else mode}), τ={_f(r[mode]['tau'])}")
    ax1.set_xlabel("draft position k")
    ax1.set_ylabel("P(x_k accepted | x_<k accepted)")
    ax1.set_ylim(0, 1)
    ax1.set_title("conditional acceptance rate")
    ax2.set_xlabel("block size k")
    ax2.set_ylabel("τ(k) = 1 + Σ(j≤k) P(x_1..x_j accepted)")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_title("acceptance length per position")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"dspark eval: {Path(report['config']['drafter']).name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- entry point
def _load(args, drafter_spec: str, dtype, device):
    target, tok = load_target_checked(args.target, dtype=dtype, device=device)
    return target, tok, load_drafter(drafter_spec, target, dtype)


@reports_cli_errors("dspark eval")
def run(args) -> int:
    sets, modes = _check_args(args)
    drafter_spec = _resolve_drafter(args.drafter, args.target)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    from generation.profiling import cpu_model

    hf_logging.disable_progress_bar()
    set_threads(args.threads)
    device = resolve_device(args.device)
    args.dtype = resolve_dtype(args.dtype, device, announce="dspark eval", target=args.target,
                               drafter=None if drafter_spec == "random" else drafter_spec)
    dtype = getattr(torch, args.dtype)
    target, tok, drafter = _load(args, drafter_spec, dtype, device)
    gamma = drafter.config.block_size
    if args.block_size is not None and args.block_size > gamma:
        raise CLIError(f"--block-size must be in [1, {gamma}] for this drafter, got {args.block_size}")
    if drafter_spec == "random":
        print("dspark eval: using a random (untrained) drafter: tau will be near 1", file=sys.stderr)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    speed = not args.no_speed
    t0 = time.perf_counter()
    body = evaluate(target, tok, drafter, sets, modes, limit=args.limit, block_size=args.block_size,
                    policy=args.policy, max_new_tokens=args.max_new_tokens, seed=args.seed, speed=speed,
                    pld=speed and not args.no_pld, pld_num_tokens=args.pld_num_tokens, progress=not args.no_progress)
    config = {
        "drafter": args.drafter if args.drafter is not None else drafter_spec,
        "target": str(args.target or "SmolLM2-135M-Instruct"), "sets": sets, "modes": modes,
        "limit": args.limit, "block_size": args.block_size or gamma, "policy": args.policy,
        "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "device": device, "seed": args.seed,
        "speed": speed, "prompt_lookup_num_tokens": args.pld_num_tokens if speed and not args.no_pld else None,
        "sts_temperatures": list(drafter.config.sts_temperatures),
        "sts_biases": list(drafter.config.sts_biases),
        "command": "dspark " + " ".join(sys.argv[1:]) if "eval" in sys.argv[1:2] else " ".join(sys.argv),
        "seconds": time.perf_counter() - t0,
        "machine": {"platform": platform.platform(), "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(),
                    "cuda": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
                    "torch": torch.__version__, "transformers": transformers.__version__},
    }
    report = {"config": config, **body}
    (out_dir / "eval.json").write_text(json.dumps(report, indent=2))
    md = markdown(report)
    (out_dir / "eval.md").write_text(md)
    plot(report, out_dir / "tau_per_position.png")
    print(md)
    print(f"[dspark] wrote {out_dir / 'eval.json'}, {out_dir / 'eval.md'}, {out_dir / 'tau_per_position.png'}")
    summ = body["summary"]
    if speed and "greedy" in modes and args.dtype == "float32" and summ.get("n_identical") != summ.get("n_compared"):
        print(f"dspark eval: LOSSLESS CHECK FAILED: {summ['n_compared'] - summ['n_identical']} float32 greedy "
              "outputs differ from plain generate()", file=sys.stderr)
        return 1
    return 0
