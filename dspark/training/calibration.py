"""Calibration of the confidence head: Sequential Temperature Scaling (docs/method.md §3).

The confidence head (docs/method.md eq. 7) gives c_k = σ(logit_k), the probability that
draft token x_k survives verification given that x_<k survived. The
scheduler (docs/method.md §4, Algorithm 1) needs the *absolute* prefix-survival
probabilities a_k = Π_{i≤k} c_i (docs/method.md eq. 9), so they must be calibrated. STS fits one
temperature per position, left to right, on held-out data:

    c_k(T_k) = σ(logit_k / T_k),   a_k = Π_{i≤k} c_i(T_i),
    T_k = argmin_{T ∈ grid} ECE(a_k, accepted[:, k])   with T_1..T_{k−1} fixed.

Extension (not in the paper): :func:`fit_sts_bias` fits a temperature *and* a logit offset per position, c_k =
σ(logit_k / T_k + b_k) (docs/method.md eq. 10). A temperature alone cannot remove a constant over- or
under-confidence: on the shipped SmolLM2 drafter, position 1 predicts ~4 points more survival than observed across
the middle of its range, and the best T leaves an ECE near 4 %. Two parameters are fitted by maximum likelihood
(Platt scaling of each conditional c_k on the blocks whose first k−1 tokens survived), not by minimising the binned
ECE: a search over a (T, b) grid fits the bins' sampling noise (on the shipped drafter's 16,939 calibration blocks
it reached an in-sample ECE of 0.86 % at position 1 but 3.45 % on held-out prompts, against 2.65 % for the
likelihood fit; two-fold split by prompt). The map stays strictly increasing in the logit (T_k > 0), so the ranking
(AUROC of c_k) is unchanged.

Data layout used throughout (positions are 0-based in arrays, 1-based in the
paper and in reports):

* ``confidence_logits`` [N, γ] pre-sigmoid confidence-head outputs;
* ``accepted`` [N, γ] 0/1: accepted[n, k] = 1 iff draft tokens 1..k of block n
  all survived verification (so it is non-increasing along k);
* ``valid`` [N, γ] bool, optional: False where the block was cut short by the
  end of a sequence. It is made prefix-closed (a position counts only if every
  earlier position of the row is valid too).

The paper's reliability figure (Fig. 6, Alpaca; docs/method.md §3) reports per position
one ROC-AUC and the ECE before → after STS. Temperature scaling is monotone
in each c_k, so the AUROC of c_k on the blocks that reach position k (prefix
survived; label: token k survives) is exactly unchanged; that is the
``auroc`` of :func:`calibration_report`. The AUROC of the *product* a_k over
all blocks is a different quantity and, for k ≥ 2, can change slightly under
STS (different T_i re-weight the factors), so it is reported separately as
``auroc_survival_before`` / ``auroc_survival_after``.

What ``dspark calibrate`` runs around the fit: held-out prompts from :mod:`dspark.training.heldout`, (raw logit,
accepted) pairs collected by driving ``generate(assistant_model=drafter)`` in :mod:`dspark.evaluation.acceptance`, and
the reliability diagram in :mod:`dspark.cli.calibrate_cmd`. Here: the metrics, the fits (:func:`fit_sts`,
:func:`fit_sts_bias`), :func:`calibration_report`, :func:`fit_and_report` (with an out-of-sample check) and
:func:`write_temperatures`, which stores the fit in a drafter's ``config.json``.

numpy, scipy and torch.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np
import torch
from scipy.optimize import minimize
from scipy.special import expit as _sigmoid  # numerically stable σ
from scipy.stats import mannwhitneyu

__all__ = [
    "survival_from_confidences",
    "expected_calibration_error",
    "auroc",
    "default_sts_grid",
    "fit_sts",
    "fit_sts_bias",
    "apply_sts",
    "calibration_report",
    "reliability_curve",
    "fit_and_report",
    "write_temperatures",
]


# ----------------------------------------------------------------------------- helpers


def _to_numpy(x: Any, dtype=np.float64) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16 or x.dtype == torch.float16:
            x = x.float()
        x = x.numpy()
    return np.asarray(x, dtype=dtype)


def _prepare(
    confidence_logits: Any, accepted: Any, valid: Any | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate and convert to (logits float64 [N, γ], accepted float64 [N, γ], valid bool [N, γ])."""
    logits = _to_numpy(confidence_logits)
    acc = _to_numpy(accepted)
    if logits.ndim != 2:
        raise ValueError(f"confidence_logits must be [N, γ], got shape {logits.shape}")
    if acc.shape != logits.shape:
        raise ValueError(f"accepted shape {acc.shape} must match confidence_logits {logits.shape}")
    if valid is None:
        ok = np.ones(logits.shape, dtype=bool)
    else:
        ok = _to_numpy(valid, dtype=bool)
        if ok.shape != logits.shape:
            raise ValueError(f"valid shape {ok.shape} must match confidence_logits {logits.shape}")
        ok = np.logical_and.accumulate(ok, axis=1)  # prefix-closed
    if not np.all((acc[ok] == 0) | (acc[ok] == 1)):
        raise ValueError("accepted must be 0/1 (or bool) at valid positions")
    if not np.all(np.isfinite(logits[ok])):
        raise ValueError("confidence_logits must be finite at valid positions")
    return logits, acc, ok


def _check_per_position(values: Sequence[float], gamma: int, what: str, positive: bool) -> np.ndarray:
    """``values`` as a float64 [γ] array of finite numbers (> 0 with ``positive``); ValueError naming ``what``."""
    v = np.asarray([float(x) for x in values], dtype=np.float64)
    if v.shape != (gamma,):
        raise ValueError(f"expected {gamma} {what}, got {v.shape[0] if v.ndim else 0}")
    if not np.all(np.isfinite(v)) or (positive and not np.all(v > 0)):
        raise ValueError(f"{what} must be finite{' and > 0' if positive else ''}, got {v.tolist()}")
    return v


def _check_temperatures(temperatures: Sequence[float], gamma: int) -> np.ndarray:
    return _check_per_position(temperatures, gamma, "temperatures", positive=True)


def _check_biases(biases: Sequence[float] | None, gamma: int) -> np.ndarray:
    return np.zeros(gamma, dtype=np.float64) if biases is None else _check_per_position(biases, gamma, "biases", False)


def _bin_index(scores: np.ndarray, n_bins: int) -> np.ndarray:
    # Equal-width bins on [0, 1]: [0, 1/n), [1/n, 2/n), ..., [(n−1)/n, 1].
    return np.minimum((scores * n_bins).astype(np.int64), n_bins - 1)


def _reaching(ok: np.ndarray, acc: np.ndarray, k: int) -> np.ndarray:
    """[N] bool: the rows valid at position k (0-based) whose tokens before k all survived, the rows c_k speaks for."""
    return ok[:, k] & (acc[:, k - 1] == 1) if k else ok[:, 0]


def _ece_rows(scores: np.ndarray, labels: np.ndarray, n_bins: int) -> np.ndarray:
    """ECE of each row of scores [G, M] against shared labels [M] → [G]."""
    g, m = scores.shape
    idx = _bin_index(scores, n_bins) + (np.arange(g, dtype=np.int64) * n_bins)[:, None]
    idx = idx.ravel()
    sum_s = np.bincount(idx, weights=scores.ravel(), minlength=g * n_bins)
    sum_y = np.bincount(idx, weights=np.broadcast_to(labels, (g, m)).ravel(), minlength=g * n_bins)
    # Σ_b |B_b|/M · |mean_s − mean_y| = Σ_b |Σ_s − Σ_y| / M
    return np.abs(sum_s - sum_y).reshape(g, n_bins).sum(axis=1) / m


def _check_scores_labels(scores: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    s = _to_numpy(scores)
    y = _to_numpy(labels)
    if s.shape != y.shape:
        raise ValueError(f"scores shape {s.shape} must match labels shape {y.shape}")
    s, y = s.ravel(), y.ravel()
    if s.size == 0:
        raise ValueError("scores is empty")
    if not np.all(np.isfinite(s)) or not np.all(np.isfinite(y)):
        raise ValueError("scores and labels must be finite")
    return s, y


# ----------------------------------------------------------------------------- metrics


def survival_from_confidences(c: Any) -> Any:
    """Prefix-survival probabilities a_k = Π_{i≤k} c_i along the last axis (docs/method.md eq. 9).

    Args:
        c: [N, γ] (or [..., γ]) conditional confidences, torch tensor or array.

    Returns:
        Same shape and kind as ``c`` (torch tensor → torch tensor, else float64 ndarray).
    """
    if isinstance(c, torch.Tensor):
        return torch.cumprod(c, dim=-1)
    return np.cumprod(_to_numpy(c), axis=-1)


def expected_calibration_error(scores: Any, labels: Any, n_bins: int = 15) -> float:
    """Standard expected calibration error with equal-width bins on [0, 1].

    ECE = Σ_b (|B_b| / M) · |mean(scores in B_b) − mean(labels in B_b)|; bin b
    is [b/n, (b+1)/n), the last bin includes 1.

    Args:
        scores: predicted probabilities in [0, 1], any shape.
        labels: outcomes in [0, 1] (normally 0/1), same shape.
        n_bins: number of bins (≥ 1).

    Returns:
        ECE as a Python float in [0, 1].
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    s, y = _check_scores_labels(scores, labels)
    if s.min() < 0 or s.max() > 1:
        raise ValueError("scores must lie in [0, 1]")
    if y.min() < 0 or y.max() > 1:
        raise ValueError("labels must lie in [0, 1]")
    return float(_ece_rows(s[None, :], y, n_bins)[0])


def auroc(scores: Any, labels: Any) -> float:
    """Area under the ROC curve: the Mann–Whitney U of the positives over n₊ n₋ (a tie counts 1/2).

    Args:
        scores: real-valued scores, any shape.
        labels: 0/1 (or bool) labels, same shape.

    Raises:
        ValueError: shapes differ, labels not binary, or only one class present.
    """
    s, y = _check_scores_labels(scores, labels)
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("labels must be 0/1")
    pos = y == 1
    n_pos = int(pos.sum())
    n_neg = s.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUROC is undefined when only one class is present")
    return float(mannwhitneyu(s[pos], s[~pos], method="asymptotic").statistic / (n_pos * n_neg))


def _auroc_or_none(scores: np.ndarray, labels: np.ndarray) -> float | None:
    if scores.size == 0 or labels.min() == labels.max():
        return None
    return auroc(scores, labels)


# ----------------------------------------------------------------------------- STS


def default_sts_grid(n: int = 301, low: float = 0.05, high: float = 20.0) -> np.ndarray:
    """STS temperature grid: ``n`` log-spaced points from ``low`` to ``high``, plus exactly 1.0
    (so "leave this position alone" is always a candidate). Sorted float64 array."""
    if not (0 < low < high) or n < 2:
        raise ValueError(f"need 0 < low < high and n >= 2, got low={low}, high={high}, n={n}")
    return np.unique(np.concatenate([np.geomspace(low, high, n), [1.0]]))


_DEFAULT_GRID = default_sts_grid()


def _check_grid(grid) -> np.ndarray:
    """The temperature grid of :func:`fit_sts` (default :func:`default_sts_grid`) as a float64 array."""
    arr = _DEFAULT_GRID if grid is None else np.asarray(grid, dtype=np.float64).ravel()
    if arr.size == 0 or not np.all(np.isfinite(arr)) or not np.all(arr > 0):
        raise ValueError("grid must be a non-empty sequence of finite temperatures > 0")
    return arr


def _fit_sequential(logits: np.ndarray, acc: np.ndarray, ok: np.ndarray, temps_grid: np.ndarray,
                    n_bins: int) -> list[float]:
    """The sequential grid search of STS; ties go to the temperature closest to 1 (log scale)."""
    tie_break = np.abs(np.log(temps_grid))
    n, gamma = logits.shape
    temps: list[float] = []
    prefix = np.ones(n, dtype=np.float64)  # calibrated a_{k−1} per row
    for k in range(gamma):
        rows = ok[:, k]
        if not rows.any():
            t_best = 1.0
        else:
            pre, lk, yk = prefix[rows], logits[rows, k], acc[rows, k]
            chunk = max(1, (1 << 22) // lk.size)
            eces = np.empty(temps_grid.size, dtype=np.float64)
            for s in range(0, temps_grid.size, chunk):
                ts = temps_grid[s : s + chunk]
                eces[s : s + chunk] = _ece_rows(pre[None, :] * _sigmoid(lk[None, :] / ts[:, None]), yk, n_bins)
            # tolerance absorbs float noise so the tie-break is meaningful
            cand = np.flatnonzero(eces <= eces.min() + 1e-12)
            t_best = float(temps_grid[cand[np.argmin(tie_break[cand])]])
        temps.append(t_best)
        prefix = prefix * _sigmoid(logits[:, k] / t_best)
    return temps


def fit_sts(
    confidence_logits: Any,
    accepted: Any,
    grid: Sequence[float] | np.ndarray | None = None,
    valid: Any | None = None,
    n_bins: int = 15,
) -> list[float]:
    """Fit Sequential Temperature Scaling temperatures T_1..T_γ (docs/method.md §3).

    For k = 1..γ in order, with T_1..T_{k−1} already fixed, pick the grid value
    T_k minimising ECE(a_k, accepted[:, k]) over the rows valid at k, where
    a_k = a_{k−1}(T_1..T_{k−1}) · σ(logit_k / T_k). Ties go to the T closest
    to 1 (in log scale). A position with no valid rows gets T_k = 1.

    Args:
        confidence_logits: [N, γ] pre-sigmoid confidence logits (held-out data).
        accepted: [N, γ] bool/0-1, accepted[n, k] = 1 iff tokens 1..k of block n survived.
        grid: candidate temperatures (> 0); default :func:`default_sts_grid` (0.05…20, 301 log-spaced points plus 1.0).
        valid: optional [N, γ] bool, False past a sequence end (made prefix-closed).
        n_bins: ECE bins.

    Returns:
        list of γ Python floats.

    Raises:
        ValueError: bad shapes, a bad grid.
    """
    logits, acc, ok = _prepare(confidence_logits, accepted, valid)
    grid_arr = _check_grid(grid)
    return _fit_sequential(logits, acc, ok, grid_arr, n_bins)


def _logistic_fit(x: np.ndarray, y: np.ndarray, min_slope: float, max_slope: float) -> tuple[float, float]:
    """Platt's fit of P(y = 1 | x) = σ(w·x + c): the log-loss with Platt's smoothed targets (positives
    (N₊+1)/(N₊+2), negatives 1/(N₋+2); keeps separable and one-class data finite), w kept in [min_slope, max_slope].
    Convex; minimised by L-BFGS-B on x divided by its standard deviation."""
    n_pos = float(y.sum())
    n_neg = float(y.size) - n_pos
    t = np.where(y > 0.5, (n_pos + 1.0) / (n_pos + 2.0), 1.0 / (n_neg + 2.0))
    scale = float(np.std(x)) or 1.0
    u = x / scale

    def loss_and_grad(p: np.ndarray) -> tuple[float, np.ndarray]:
        z = p[0] * u + p[1]
        r = _sigmoid(z) - t
        return float(np.mean(np.logaddexp(0.0, z) - t * z)), np.array([np.mean(r * u), np.mean(r)])

    prior = (n_pos + 1.0) / (y.size + 2.0)
    lo, hi = min_slope * scale, max_slope * scale  # slope bounds in the standardised units
    start = [min(max(0.0, lo), hi), math.log(prior / (1.0 - prior))]  # no slope, the smoothed base rate
    res = minimize(loss_and_grad, start, jac=True, method="L-BFGS-B", bounds=[(lo, hi), (None, None)],
                   options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 1000})
    return float(res.x[0] / scale), float(res.x[1])


def fit_sts_bias(
    confidence_logits: Any,
    accepted: Any,
    *,
    valid: Any | None = None,
    min_temperature: float = 0.05,
    max_temperature: float = 20.0,
) -> tuple[list[float], list[float]]:
    """Temperature and logit offset per position by maximum likelihood (extension, module doc):
    c_k = σ(logit_k / T_k + b_k).

    For each position k, (1/T_k, b_k) is Platt scaling (logistic regression with Platt's smoothed targets) of
    "token k survives" on logit_k over the blocks whose tokens 1..k−1 survived (and are valid at k): the
    conditional probability that c_k stands for (docs/method.md eq. 7). The product a_k = Π c_i is then checked, not
    guaranteed, to be calibrated: :func:`calibration_report` measures its ECE. T_k is kept in
    [``min_temperature``, ``max_temperature``] (the map stays increasing, and a handful of separable rows cannot
    drive it to a step); a position that no block reaches gets (1, 0).

    Args:
        confidence_logits, accepted, valid: as :func:`fit_sts`.
        min_temperature, max_temperature: bounds of T_k (default 0.05 and 20, the range of
            :func:`default_sts_grid`).

    Returns:
        (temperatures, biases): two lists of γ Python floats.

    Raises:
        ValueError: bad shapes or values, bounds not 0 < min_temperature ≤ max_temperature.
    """
    logits, acc, ok = _prepare(confidence_logits, accepted, valid)
    if not 0 < min_temperature <= max_temperature:
        raise ValueError(f"need 0 < min_temperature <= max_temperature, got {min_temperature}, {max_temperature}")
    temps: list[float] = []
    biases: list[float] = []
    for k in range(logits.shape[1]):
        rows = _reaching(ok, acc, k)
        if not rows.any():
            temps.append(1.0)
            biases.append(0.0)
            continue
        w, c = _logistic_fit(logits[rows, k], acc[rows, k], 1.0 / max_temperature, 1.0 / min_temperature)
        temps.append(1.0 / w)
        biases.append(c)
    return temps, biases


def apply_sts(confidence_logits: Any, temperatures: Sequence[float], biases: Sequence[float] | None = None) -> Any:
    """Calibrated confidences c_k = σ(logit_k / T_k + b_k) (docs/method.md §3; b_k = 0 unless :func:`fit_sts_bias`
    was used).

    Args:
        confidence_logits: [..., γ] pre-sigmoid logits; torch tensor (any
            device) or array.
        temperatures: γ temperatures from :func:`fit_sts` / :func:`fit_sts_bias`.
        biases: γ logit offsets from :func:`fit_sts_bias`, or None (all 0).

    Returns:
        torch input → torch tensor on the same device, float32 (float64 if
        the input is float64); otherwise a float64 ndarray. Same shape.

    Raises:
        ValueError: not γ temperatures (finite, > 0) or γ finite biases.
    """
    if isinstance(confidence_logits, torch.Tensor):
        gamma = confidence_logits.shape[-1] if confidence_logits.dim() else 0
        t = _check_temperatures(temperatures, gamma)
        b = _check_biases(biases, gamma)
        dtype = torch.float64 if confidence_logits.dtype == torch.float64 else torch.float32
        t_t = torch.as_tensor(t, dtype=dtype, device=confidence_logits.device)
        b_t = torch.as_tensor(b, dtype=dtype, device=confidence_logits.device)
        return torch.sigmoid(confidence_logits.to(dtype) / t_t + b_t)
    x = _to_numpy(confidence_logits)
    gamma = x.shape[-1] if x.ndim else 0
    t = _check_temperatures(temperatures, gamma)
    return _sigmoid(x / t + _check_biases(biases, gamma))


# ----------------------------------------------------------------------------- report


def reliability_curve(scores: np.ndarray, labels: np.ndarray, n_bins: int = 15):
    """``(mean score, empirical rate, count)`` per non-empty equal-width bin on [0, 1] of scores [M] against 0/1
    labels [M] (the points of a reliability diagram), three float64 / int64 arrays of one length."""
    idx = _bin_index(scores, n_bins)
    cnt = np.bincount(idx, minlength=n_bins)
    s_sum = np.bincount(idx, weights=scores, minlength=n_bins)
    y_sum = np.bincount(idx, weights=labels, minlength=n_bins)
    nz = cnt > 0
    return s_sum[nz] / cnt[nz], y_sum[nz] / cnt[nz], cnt[nz]


def _survival_pair(logits: np.ndarray, temps: np.ndarray, biases: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    before = survival_from_confidences(_sigmoid(logits))
    after = survival_from_confidences(_sigmoid(logits / temps[None, :] + biases[None, :]))
    return before, after


def calibration_report(
    confidence_logits: Any,
    accepted: Any,
    temperatures: Sequence[float],
    valid: Any | None = None,
    n_bins: int = 15,
    biases: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Per-position discrimination and calibration before/after STS (cf. paper Fig. 6, docs/method.md §3).

    Returns a JSON-serialisable dict::

        {"n_bins": int, "temperatures": [T_1..T_γ], "biases": [b_1..b_γ] (0 without ``biases``),
         "mean_ece_before": float, "mean_ece_after": float,   # over positions with data
         "positions": [{
             "position": k (1-based), "n": rows valid at k,
             "accept_rate": mean of accepted[:, k],
             "ece_before": ECE(a_k raw), "ece_after": ECE(a_k after STS),
             "auroc": AUROC of c_k on rows whose prefix 1..k−1 survived (label:
                      token k survived) — unchanged by STS, or null,
             "n_conditional": number of those rows,
             "auroc_survival_before" / "auroc_survival_after": AUROC of a_k vs
                      accepted[:, k] over all valid rows, or null,
         }, ...]}

    A value is null (None) where it is undefined (no rows, or one class only).
    """
    logits, acc, ok = _prepare(confidence_logits, accepted, valid)
    temps = _check_temperatures(temperatures, logits.shape[1])
    bias = _check_biases(biases, logits.shape[1])
    a_before, a_after = _survival_pair(logits, temps, bias)
    positions = []
    for k in range(logits.shape[1]):
        rows = ok[:, k]
        entry: dict[str, Any] = {"position": k + 1, "n": int(rows.sum())}
        cond = _reaching(ok, acc, k)
        entry["n_conditional"] = int(cond.sum())
        if rows.any():
            y = acc[rows, k]
            entry["accept_rate"] = float(y.mean())
            entry["ece_before"] = expected_calibration_error(a_before[rows, k], y, n_bins)
            entry["ece_after"] = expected_calibration_error(a_after[rows, k], y, n_bins)
            entry["auroc_survival_before"] = _auroc_or_none(a_before[rows, k], y)
            entry["auroc_survival_after"] = _auroc_or_none(a_after[rows, k], y)
        else:
            for key in ("accept_rate", "ece_before", "ece_after", "auroc_survival_before", "auroc_survival_after"):
                entry[key] = None
        entry["auroc"] = _auroc_or_none(logits[cond, k], acc[cond, k]) if cond.any() else None
        positions.append(entry)
    with_data = [p for p in positions if p["ece_before"] is not None]
    return {
        "n_bins": int(n_bins),
        "temperatures": [float(t) for t in temps],
        "biases": [float(b) for b in bias],
        "mean_ece_before": float(np.mean([p["ece_before"] for p in with_data])) if with_data else None,
        "mean_ece_after": float(np.mean([p["ece_after"] for p in with_data])) if with_data else None,
        "positions": positions,
    }


# ----------------------------------------------------------------------------- fit, write


def fit_and_report(pairs: dict, n_bins: int = 15, bias: bool = False) -> dict:
    """Fit on all pairs and report before/after per position, plus an out-of-sample check.

    Args:
        pairs: :func:`dspark.evaluation.acceptance.collect_pairs` / :func:`dspark.evaluation.acceptance.load_pairs`
            arrays: ``logits``, ``accepted``, ``valid`` [N, γ] and ``prompt_index`` [N].
        n_bins: ECE bins.
        bias: fit a temperature and a logit offset per position (:func:`fit_sts_bias`) instead of STS
            (:func:`fit_sts`, offsets 0).

    Returns:
        :func:`calibration_report`'s dict plus ``method``, ``two_fold_ece_after`` (per position: ECE of a_k on the
        prompts of one parity of ``prompt_index``, fitted on the other, weighted over both folds; None where no
        row), ``n_blocks``, ``max_ece_after`` and ``bar_ece_after_le_3pct`` (every position's ECE ≤ 3 %).

    Raises:
        ValueError: no pair at position 1 (empty generations).
    """

    def fit(lg, ac, va):
        if bias:
            return fit_sts_bias(lg, ac, valid=va)
        return fit_sts(lg, ac, valid=va, n_bins=n_bins), [0.0] * lg.shape[1]

    logits, acc, valid = pairs["logits"], pairs["accepted"], pairs["valid"]
    if logits.shape[0] == 0 or not valid[:, 0].any():
        raise ValueError("no calibration pairs were collected (empty generations?)")
    temps, biases = fit(logits, acc, valid)
    report = calibration_report(logits, acc, temps, valid=valid, n_bins=n_bins, biases=biases)
    report["method"] = ("STS + logit offset per position, maximum likelihood (--bias)" if bias
                        else "STS (docs/method.md §3)")

    owner = pairs["prompt_index"]
    ok = np.logical_and.accumulate(valid, axis=1)
    gamma = logits.shape[1]
    err_sum, err_n = np.zeros(gamma), np.zeros(gamma)
    for parity in (0, 1):
        tr, te = owner % 2 == parity, owner % 2 != parity
        if not valid[tr, 0].any() or not valid[te, 0].any():
            continue
        t_fold, b_fold = fit(logits[tr], acc[tr], valid[tr])
        a = survival_from_confidences(apply_sts(logits[te], t_fold, b_fold))
        for k in range(gamma):
            rows = ok[te, k]
            if rows.any():
                n = int(rows.sum())
                err_sum[k] += n * expected_calibration_error(a[rows, k], acc[te][rows, k], n_bins)
                err_n[k] += n
    report["two_fold_ece_after"] = [float(e / n) if n else None for e, n in zip(err_sum, err_n)]
    report["n_blocks"] = int(logits.shape[0])
    report["max_ece_after"] = max((p["ece_after"] for p in report["positions"] if p["ece_after"] is not None),
                                  default=None)
    report["bar_ece_after_le_3pct"] = report["max_ece_after"] is not None and report["max_ece_after"] <= 0.03
    return report


def write_temperatures(drafter_path: str | os.PathLike, temperatures: Sequence[float],
                       biases: Sequence[float] | None = None) -> tuple[list[float], list[float]]:
    """Store ``temperatures`` as ``sts_temperatures`` and ``biases`` as ``sts_biases`` (None: all 0) in
    ``drafter_path/config.json`` (config only; the weights are not rewritten).

    Returns:
        ``(previous temperatures, previous biases)``.

    Raises:
        ValueError: not one value per position of the drafter's block.
    """
    from modeling_dspark import DSparkConfig

    config = DSparkConfig.from_pretrained(drafter_path)
    previous = list(config.sts_temperatures), list(config.sts_biases)
    if len(temperatures) != config.block_size:
        raise ValueError(f"need {config.block_size} temperatures, got {len(temperatures)}")
    if biases is not None and len(biases) != config.block_size:
        raise ValueError(f"need {config.block_size} biases, got {len(biases)}")
    config.sts_temperatures = [float(t) for t in temperatures]
    config.sts_biases = [float(b) for b in biases] if biases is not None else [0.0] * config.block_size
    config.validate_fields()
    config.save_pretrained(drafter_path)
    return previous
