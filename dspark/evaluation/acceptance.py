"""Acceptance by draft position, collected by driving ``generate(assistant_model=drafter)``.

:func:`acceptance_matrix` turns the rounds of one ``generate()`` call (:class:`dspark.generation.stats.RoundStats`) into
per-position labels, :func:`acceptance_by_position` summarises them (``dspark eval``), and :func:`collect_pairs` runs
the full-block policy on prompts and records each drafted slot's raw confidence logit with its label (the data of
``dspark calibrate``), stored and merged by :func:`save_pairs` / :func:`load_pairs`.

Arrays: ``accepted`` [N, γ] int8 0/1 (1 iff draft tokens 1..k all survived), ``valid`` [N, γ] bool (False where the
block was cut short), ``logits`` [N, γ] float64 raw confidence logits, ``prompt_index`` [N] int64.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

PAIR_ARRAYS = ("logits", "accepted", "valid", "prompt_index")
"""The arrays of a pairs file (:func:`save_pairs`)."""


def acceptance_matrix(rounds, gamma: int, eos_ids: Sequence[int] = (), last_round_hit_eos: bool = False):
    """Per-position acceptance labels of the rounds of one ``generate()`` call.

    Args:
        rounds: the :class:`dspark.generation.stats.RoundStats` of the call (``drafted``, ``accepted``,
            ``draft_tokens``).
        gamma: number of positions (the block size used).
        eos_ids: EOS token ids of the target.
        last_round_hit_eos: the call's final token is an EOS committed by the last round.

    Returns:
        ``(accepted [R, γ] int8, valid [R, γ] bool)`` numpy arrays. ``accepted[r, k] = 1`` iff draft tokens 1..k+1
        (1-based) survived. Positions past ``drafted`` are invalid. transformers crops its match count at the first
        EOS it commits; so in an EOS-ending last round, a draft EOS at slot ``accepted + 1`` that equals the committed
        EOS was in fact accepted (label 1) and the later slots are unknown (invalid).
    """
    n = len(rounds)
    acc = np.zeros((n, gamma), dtype=np.int8)
    valid = np.zeros((n, gamma), dtype=bool)
    for i, r in enumerate(rounds):
        d, a = min(int(r.drafted), gamma), min(int(r.accepted), gamma)
        acc[i, :a] = 1
        valid[i, :d] = True
        if i == n - 1 and last_round_hit_eos and a < d:
            if a < len(r.draft_tokens) and int(r.draft_tokens[a]) in set(eos_ids):
                acc[i, a] = 1
                valid[i, a + 1:] = False
    return acc, valid


def ends_with_committed_eos(new_ids: Sequence[int], rounds, eos_ids: Sequence[int]) -> bool:
    """Whether a ``generate()`` call's last new token is an EOS that its last round committed (not the prefill's
    token): the ``last_round_hit_eos`` of :func:`acceptance_matrix`."""
    return bool(new_ids) and new_ids[-1] in eos_ids and sum(r.committed for r in rounds) + 1 == len(new_ids)


def acceptance_by_position(accepted: np.ndarray, valid: np.ndarray) -> dict:
    """Per-position statistics of :func:`acceptance_matrix` rows.

    Args:
        accepted: ``[N, γ]`` 0/1 labels; valid: ``[N, γ]`` bool (made prefix-closed here).

    Returns:
        lists of γ values: ``conditional_accept_rate`` (P(x_k accepted | x_<k accepted), None without rows) and
        its row counts ``n_conditional``, ``survival`` (P(x_1..x_k accepted), None without rows) and ``n_valid``,
        and ``implied_tau_at_block_size`` (1 + Σ_{j≤k} survival_j).
    """
    ok = np.logical_and.accumulate(valid, axis=1) if valid.size else valid
    cond, n_cond, surv, n_valid = [], [], [], []
    for k in range(accepted.shape[1]):
        rows = ok[:, k]
        c = rows & (accepted[:, k - 1] == 1) if k else rows  # prefix survived
        n_cond.append(int(c.sum()))
        cond.append(float(accepted[c, k].mean()) if c.any() else None)
        n_valid.append(int(rows.sum()))
        surv.append(float(accepted[rows, k].mean()) if rows.any() else None)
    implied = (1.0 + np.cumsum([s or 0.0 for s in surv])).tolist()
    return {"conditional_accept_rate": cond, "n_conditional": n_cond, "survival": surv, "n_valid": n_valid,
            "implied_tau_at_block_size": implied}


@contextlib.contextmanager
def _recorded_confidence_logits(drafter):
    """The raw float32 logit of every confidence-head forward while the block runs, in call order (a forward hook:
    the value the drafter turns into c_k with its temperatures, so no sigmoid inversion and no saturation)."""
    logits: list[float] = []
    handle = drafter.confidence_head.register_forward_hook(lambda _m, _i, out: logits.extend(out.reshape(-1).tolist()))
    try:
        yield logits
    finally:
        handle.remove()


def _full_block_generate(target, drafter, ids: Sequence[int], gamma: int, kw: dict):
    """One ``generate(assistant_model=drafter)`` call on prompt ``ids`` with the full-block policy and no lookup
    proposer: ``(new token ids, rounds, raw confidence logits)``, one logit per drafted token.

    Raises:
        RuntimeError: the recorded logits do not match the drafted tokens (the policy was overridden).
    """
    from dspark.generation import collect_stats, dspark_options

    x = torch.tensor([list(ids)], device=target.device)
    with torch.inference_mode(), collect_stats() as runs, _recorded_confidence_logits(drafter) as raw, \
            dspark_options(policy="full", block_size=gamma, lookup=False):
        out = target.generate(x, attention_mask=torch.ones_like(x), assistant_model=drafter, **kw)
    rounds = runs[-1].rounds if runs else []
    if sum(r.drafted for r in rounds) != len(raw):
        raise RuntimeError(f"confidence calls ({len(raw)}) do not match drafted tokens "
                           f"({sum(r.drafted for r in rounds)}): was the full-block policy overridden?")
    return out[0, x.shape[1]:].tolist(), rounds, raw


def _slot_logits(rounds, raw: Sequence[float], gamma: int) -> np.ndarray:
    """The ``[R, γ]`` raw logits of the rounds' drafted slots, in the order the drafter produced them (0 where no
    slot was drafted)."""
    lg = np.zeros((len(rounds), gamma), dtype=np.float64)
    c = 0
    for i, r in enumerate(rounds):  # one logit per drafted slot, slot by slot
        lg[i, :r.drafted] = raw[c:c + r.drafted]
        c += r.drafted
    return lg


def collect_pairs(target, tokenizer, drafter, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
                  do_sample: bool = False, seed: int = 0, progress: bool = False) -> dict:
    """Run ``target.generate(assistant_model=drafter)`` with the full-block policy (every slot verified, so every
    position gets a label; no lookup proposer) on each prompt and collect per-position (raw logit, accepted) pairs.

    Args:
        target, tokenizer: the target model and its tokenizer.
        drafter: a :class:`modeling_dspark.DSparkDraftModel` with a confidence head, bound to ``target``.
        prompt_ids: token ids per prompt (chat template applied).
        max_new_tokens: most new tokens per prompt.
        do_sample: T = 1 sampling (rejection-sampling acceptance) instead of greedy; prompt i is seeded
            ``seed + i``.
        progress: a tqdm bar on stderr.

    Returns:
        dict of numpy arrays: ``logits [N, γ]`` float64 raw (pre-temperature) confidence logits (0 where invalid),
        ``accepted [N, γ]`` int8 and ``valid [N, γ]`` bool (:func:`acceptance_matrix`), ``prompt_index [N]``
        int64 (which prompt each round came from); and ``new_tokens`` (int, total generated).

    Raises:
        ValueError: the drafter has no confidence head.
        RuntimeError: the recorded logits do not match the drafted tokens (the policy was overridden).
    """
    from tqdm.auto import tqdm

    from dspark.training.data import eos_token_ids

    if drafter.confidence_head is None:
        raise ValueError("this drafter has no confidence head (use_confidence_head=False): nothing to calibrate")
    gamma = drafter.config.block_size
    eos = eos_token_ids(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else None)
    kw = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "pad_token_id": pad}
    if do_sample:
        kw.update(temperature=1.0, top_p=1.0, top_k=0)
    logits_rows, acc_rows, valid_rows, owner = [], [], [], []
    new_tokens = 0
    for pi, ids in enumerate(tqdm(prompt_ids, desc="calibrate", disable=not progress, file=sys.stderr)):
        if do_sample:
            torch.manual_seed(seed + pi)
        new, rounds, raw = _full_block_generate(target, drafter, ids, gamma, kw)
        new_tokens += len(new)
        acc, valid = acceptance_matrix(rounds, gamma, eos, ends_with_committed_eos(new, rounds, eos))
        logits_rows.append(_slot_logits(rounds, raw, gamma))
        acc_rows.append(acc)
        valid_rows.append(valid)
        owner.append(np.full(len(rounds), pi, dtype=np.int64))
    cat = (lambda xs, shape, dt: np.concatenate(xs) if xs else np.zeros(shape, dtype=dt))
    return {
        "logits": cat(logits_rows, (0, gamma), np.float64),
        "accepted": cat(acc_rows, (0, gamma), np.int8),
        "valid": cat(valid_rows, (0, gamma), bool),
        "prompt_index": cat(owner, (0,), np.int64),
        "new_tokens": new_tokens,
    }


# ----------------------------------------------------------------------------- pairs files


def save_pairs(path: str | os.PathLike, pairs: dict, prompt_ids: Sequence[str]) -> None:
    """Write the arrays of :func:`collect_pairs` (:data:`PAIR_ARRAYS`) and the prompts' ids (``prompt_ids``, one per
    prompt index) to a compressed ``.npz`` file that :func:`load_pairs` reads."""
    np.savez_compressed(path, **{k: pairs[k] for k in PAIR_ARRAYS}, prompt_ids=np.array([str(p) for p in prompt_ids]))


def load_pairs(files: Sequence[str | os.PathLike]) -> dict:
    """Concatenate the pairs of several ``.npz`` files (:func:`save_pairs`, earlier ``dspark calibrate`` runs).

    Each file's ``prompt_index`` is shifted past the previous files' largest index, so prompts stay distinct (the
    2-fold check of :func:`fit_and_report` splits by prompt).

    Returns:
        ``{"logits" [N, γ] float, "accepted" [N, γ], "valid" [N, γ] bool, "prompt_index" [N] int64}``.

    Raises:
        ValueError: a file named twice, an unreadable or corrupt file, a missing array, shapes that do not fit
            (block sizes that differ), or a prompt id in two files (files that store prompt ids); the message starts
            with the file's name.
    """
    parts: dict[str, list] = {k: [] for k in PAIR_ARRAYS}
    offset, gamma = 0, None
    seen_paths: set[Path] = set()
    seen_ids: dict[str, str] = {}
    for f in files:
        path = Path(f).resolve()
        if path in seen_paths:
            raise ValueError(f"{f} is given twice (its prompts would count in both halves of the 2-fold check)")
        seen_paths.add(path)
        try:
            with np.load(f) as z:
                got = {k: z[k] for k in PAIR_ARRAYS}
                ids = [str(i) for i in z["prompt_ids"]] if "prompt_ids" in z.files else []
        except KeyError as err:
            raise ValueError(f"{f}: missing array {err} (not a `dspark calibrate` pairs.npz)") from None
        except Exception as err:  # zipfile.BadZipFile, OSError, ValueError, TypeError (a .npy), ...
            raise ValueError(f"{f}: cannot read ({type(err).__name__}: {err})") from None
        n = got["logits"].shape[0] if got["logits"].ndim == 2 else -1
        g = got["logits"].shape[1] if n >= 0 else None
        if (g is None or (gamma is not None and g != gamma) or got["accepted"].shape != got["logits"].shape
                or got["valid"].shape != got["logits"].shape or got["prompt_index"].shape != (n,)):
            raise ValueError(f"{f}: arrays of shapes logits {got['logits'].shape}, accepted "
                             f"{got['accepted'].shape}, valid {got['valid'].shape}, prompt_index "
                             f"{got['prompt_index'].shape}; expected [N, {gamma or 'γ'}] ×3 and [N]")
        gamma = g
        if ids and len(ids) != (int(got["prompt_index"].max()) + 1 if n else 0):
            raise ValueError(f"{f}: {len(ids)} prompt ids for {int(got['prompt_index'].max()) + 1} prompts")
        for pid in ids:
            if pid in seen_ids:
                raise ValueError(f"{f}: prompt {pid!r} is also in {seen_ids[pid]}")
            seen_ids[pid] = str(f)
        got["prompt_index"] = got["prompt_index"].astype(np.int64) + offset
        offset = int(got["prompt_index"].max()) + 1 if got["prompt_index"].size else offset
        for k in PAIR_ARRAYS:
            parts[k].append(got[k])
    return {k: np.concatenate(v) for k, v in parts.items()}
