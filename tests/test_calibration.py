"""Tests for dspark.training.calibration (docs/method.md §3, Sequential Temperature Scaling)."""

import json
import math

import numpy as np
import pytest
import torch

from dspark.training.calibration import (
    apply_sts,
    auroc,
    calibration_report,
    default_sts_grid,
    expected_calibration_error,
    fit_sts,
    fit_sts_bias,
    survival_from_confidences,
)


def _synthetic(n, gamma, seed, scale=3.0):
    """True conditional acceptance q = σ(z); the 'head' reports logits scale·z (over-confident
    for scale > 1). accepted[:, k] = all tokens 1..k survived."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.0, 1.2, size=(n, gamma))
    q = 1.0 / (1.0 + np.exp(-z))
    survive = rng.random((n, gamma)) < q
    accepted = np.logical_and.accumulate(survive, axis=1)
    return scale * z, accepted


# ----------------------------------------------------------------------------- ECE / AUROC


def test_ece_hand_cases():
    # one bin (n_bins=1): |mean score − mean label|
    assert expected_calibration_error([0.2, 0.4], [0, 1], n_bins=1) == pytest.approx(0.2)
    # perfectly calibrated in each bin
    assert expected_calibration_error([0.25, 0.25, 0.25, 0.25], [1, 0, 0, 0], n_bins=4) == pytest.approx(0.0)
    # two bins with 10 bins: bin of 0.9 (2 samples, 1 positive): |0.9−0.5|·2/4;
    # bin of 0.1 (2 samples, 0 positive): |0.1−0|·2/4  → 0.2 + 0.05
    assert expected_calibration_error([0.9, 0.9, 0.1, 0.1], [1, 0, 0, 0], n_bins=10) == pytest.approx(0.25)
    # score 1.0 lands in the last bin
    assert expected_calibration_error([1.0, 1.0], [1, 1], n_bins=15) == pytest.approx(0.0)
    # torch inputs work too
    assert expected_calibration_error(torch.tensor([0.2, 0.4]), torch.tensor([False, True]), n_bins=1) == pytest.approx(0.2)


def test_auroc_hand_cases():
    assert auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auroc([0.1, 0.2, 0.3], [0, 1, 1]) == pytest.approx(1.0)
    assert auroc([0.3, 0.2, 0.1], [0, 1, 1]) == pytest.approx(0.0)
    # ties count 1/2
    assert auroc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)
    assert auroc([0.5, 0.5, 0.9, 0.1], [0, 1, 1, 0]) == pytest.approx((1 + 1 + 1 + 0.5) / 4)


def test_auroc_matches_scipy_mannwhitney():
    import scipy.stats as scipy_stats
    rng = np.random.default_rng(0)
    s = rng.integers(0, 5, 200).astype(float)  # many ties
    y = rng.random(200) < 0.4
    u = scipy_stats.mannwhitneyu(s[y], s[~y]).statistic
    assert auroc(s, y) == pytest.approx(u / (y.sum() * (~y).sum()), abs=1e-12)


def test_metric_errors():
    with pytest.raises(ValueError):
        auroc([0.1, 0.2], [1, 1])
    with pytest.raises(ValueError):
        auroc([0.1, 0.2, 0.3], [0, 1])
    with pytest.raises(ValueError):
        expected_calibration_error([0.1, 0.2, 0.3], [0, 1])
    with pytest.raises(ValueError):
        expected_calibration_error([0.1, 1.2], [0, 1])
    with pytest.raises(ValueError):
        expected_calibration_error([], [])


def test_survival_from_confidences():
    c = np.array([[0.9, 0.5, 0.5], [1.0, 0.2, 1.0]])
    np.testing.assert_allclose(survival_from_confidences(c), [[0.9, 0.45, 0.225], [1.0, 0.2, 0.2]])
    t = survival_from_confidences(torch.tensor(c, dtype=torch.float32))
    assert isinstance(t, torch.Tensor)
    assert torch.allclose(t, torch.tensor([[0.9, 0.45, 0.225], [1.0, 0.2, 0.2]]))


# ----------------------------------------------------------------------------- STS


def test_apply_sts():
    logits = np.array([[0.0, 2.0, -4.0]])
    out = apply_sts(logits, [1.0, 2.0, 4.0])
    np.testing.assert_allclose(out, 1 / (1 + np.exp(-np.array([[0.0, 1.0, -1.0]]))))
    tt = apply_sts(torch.tensor(logits, dtype=torch.bfloat16), [1.0, 2.0, 4.0])
    assert tt.dtype == torch.float32 and tt.shape == (1, 3)
    with pytest.raises(ValueError):
        apply_sts(logits, [1.0, 2.0])
    with pytest.raises(ValueError):
        apply_sts(logits, [1.0, 0.0, 1.0])


def test_sts_fixes_overconfidence_and_keeps_ranking():
    gamma = 5
    fit_logits, fit_acc = _synthetic(30000, gamma, seed=0)
    temps = fit_sts(fit_logits, fit_acc)
    assert len(temps) == gamma and all(isinstance(t, float) for t in temps)
    # the logits are the true ones ×3, so the recovered temperatures are close to 3
    assert all(2.0 < t < 4.5 for t in temps), temps

    test_logits, test_acc = _synthetic(30000, gamma, seed=1)  # held-out evaluation
    rep = calibration_report(test_logits, test_acc, temps)
    json.dumps(rep)  # JSON-serialisable
    assert [p["position"] for p in rep["positions"]] == list(range(1, gamma + 1))
    for p in rep["positions"]:
        assert p["ece_after"] < p["ece_before"], p
        assert p["ece_after"] < 0.02, p
    assert rep["mean_ece_after"] < rep["mean_ece_before"]

    # monotone per position: AUROC of c_k on blocks reaching k is unchanged (docs/method.md §3)
    c_before = 1 / (1 + np.exp(-test_logits))
    c_after = apply_sts(test_logits, temps)
    for k in range(gamma):
        rows = test_acc[:, k - 1] if k > 0 else np.ones(len(test_acc), bool)
        a_b = auroc(c_before[rows, k], test_acc[rows, k])
        a_a = auroc(c_after[rows, k], test_acc[rows, k])
        assert abs(a_b - a_a) < 1e-9
        assert rep["positions"][k]["auroc"] == pytest.approx(a_b, abs=1e-12)
    # position 1's survival a_1 = c_1: its AUROC is unchanged too
    p1 = rep["positions"][0]
    assert abs(p1["auroc_survival_before"] - p1["auroc_survival_after"]) < 1e-9


def test_sts_on_calibrated_scores_stays_near_one():
    logits, acc = _synthetic(30000, 3, seed=2, scale=1.0)
    temps = fit_sts(logits, acc)
    assert all(0.75 < t < 1.33 for t in temps), temps


def test_sts_valid_mask():
    gamma = 4
    logits, acc = _synthetic(20000, gamma, seed=3)
    rng = np.random.default_rng(4)
    cut = rng.integers(1, gamma + 1, size=len(logits))  # block length before a sequence end
    valid = np.arange(gamma)[None, :] < cut[:, None]
    # garbage past the end must not matter
    logits_g, acc_g = logits.copy(), acc.astype(float)
    logits_g[~valid] = np.nan
    acc_g[~valid] = -1
    temps = fit_sts(logits_g, acc_g, valid=valid)
    assert temps == fit_sts(logits, acc, valid=valid)
    # position 1 is valid everywhere (cut >= 1), so T_1 matches a fit on column 1 alone
    assert temps[0] == fit_sts(logits[:, :1], acc[:, :1])[0]
    # a non-prefix-closed mask is made prefix-closed: a hole at k hides k+1.. too
    holes = valid.copy()
    holes[::2, 1] = False
    closed = np.logical_and.accumulate(holes, axis=1)
    assert fit_sts(logits, acc, valid=holes) == fit_sts(logits, acc, valid=closed)
    assert len(temps) == gamma and all(np.isfinite(temps))
    rep = calibration_report(logits_g, acc_g, temps, valid=valid)
    for k, p in enumerate(rep["positions"]):
        assert p["n"] == int(valid[:, k].sum())
        assert p["ece_after"] < p["ece_before"]
    # a position with no data at all gets T = 1
    valid2 = valid.copy()
    valid2[:, -1] = False
    assert fit_sts(logits_g, acc_g, valid=valid2)[-1] == 1.0
    rep2 = calibration_report(logits_g, acc_g, temps, valid=valid2)
    assert rep2["positions"][-1]["ece_before"] is None and rep2["positions"][-1]["auroc"] is None
    json.dumps(rep2)


def test_sts_is_sequential():
    """T_k is chosen with T_1..T_{k−1} fixed: position 2's data alone is
    calibrated only after position 1 is corrected."""
    rng = np.random.default_rng(5)
    n = 40000
    z1 = rng.normal(2.0, 1.0, n)
    z2 = rng.normal(1.0, 1.0, n)
    s1 = rng.random(n) < 1 / (1 + np.exp(-z1))
    s2 = rng.random(n) < 1 / (1 + np.exp(-z2))
    acc = np.column_stack([s1, s1 & s2])
    logits = np.column_stack([4.0 * z1, z2])  # only position 1 is miscalibrated
    temps = fit_sts(logits, acc)
    assert 3.0 < temps[0] < 5.5
    assert 0.7 < temps[1] < 1.4


def test_sts_grid_and_shape_errors():
    logits, acc = _synthetic(100, 3, seed=6)
    g = default_sts_grid()
    assert g[0] == pytest.approx(0.05) and g[-1] == pytest.approx(20.0) and 1.0 in g and len(g) >= 200
    t = fit_sts(logits, acc, grid=[0.5, 1.0, 2.0])
    assert set(t) <= {0.5, 1.0, 2.0}
    with pytest.raises(ValueError):
        fit_sts(logits, acc[:, :2])
    with pytest.raises(ValueError):
        fit_sts(logits[:, 0], acc[:, 0])
    with pytest.raises(ValueError):
        fit_sts(logits, acc, valid=np.ones((100, 2), bool))
    with pytest.raises(ValueError):
        fit_sts(logits, acc, grid=[1.0, -1.0])
    with pytest.raises(ValueError):
        fit_sts(logits, acc.astype(float) * 0.5)
    with pytest.raises(ValueError):
        calibration_report(logits, acc, [1.0, 1.0])
    # torch inputs
    tt = fit_sts(torch.tensor(logits, dtype=torch.float32), torch.tensor(acc), grid=[0.5, 1.0, 2.0])
    assert len(tt) == 3


def test_plot_reliability(tmp_path, saved_figures):
    """One panel per asked position: the diagonal, the raw and the calibrated curve, each labelled with the ECE that
    calibration_report computes; the PNG decodes at the figure's size (3 panels of 3.2 in at 120 dpi)."""
    import matplotlib.pyplot as plt

    from dspark.cli.calibrate_cmd import plot_reliability

    logits, acc = _synthetic(3000, 5, seed=7)
    temps = fit_sts(logits, acc)
    path = plot_reliability(logits, acc, temps, str(tmp_path / "rel.png"), positions=[1, 3, 5], title="synthetic")
    (fig,) = saved_figures
    report = calibration_report(logits, acc, temps)
    assert [ax.get_title().split(",")[0] for ax in fig.axes] == ["position 1", "position 3", "position 5"]
    for ax, k in zip(fig.axes, (0, 2, 4)):
        diagonal, raw, sts = ax.get_lines()
        assert list(diagonal.get_xdata()) == [0, 1] == list(diagonal.get_ydata())
        ece = report["positions"][k]
        assert raw.get_label() == f"raw, ECE {100 * ece['ece_before']:.1f}%"
        assert sts.get_label() == f"STS (T={temps[k]:.2f}), ECE {100 * ece['ece_after']:.1f}%"
    assert plt.imread(path).shape[:2] == (round(3.2 * 120), round(3 * 3.2 * 120))
    with pytest.raises(ValueError):
        plot_reliability(logits, acc, temps, str(tmp_path / "x.png"), positions=[6])


def _offset_synthetic(n, gamma, seed, offset=1.0):
    """True conditional acceptance q = σ(z); the head reports z + offset (a constant over-confidence)."""
    logits, acc = _synthetic(n, gamma, seed, scale=1.0)
    return logits + offset, acc


def test_sts_bias_removes_a_constant_overconfidence_that_sts_cannot():
    """A head over-confident by a constant logit offset: STS's best temperature leaves a large ECE; STS + offset
    (fit_sts_bias, maximum likelihood) recovers T ≈ 1, b ≈ −offset at every position and a small held-out ECE;
    the ranking is unchanged."""
    gamma, small_t = 3, default_sts_grid(61)
    fit_logits, fit_acc = _offset_synthetic(20000, gamma, seed=10)
    temps_only = fit_sts(fit_logits, fit_acc, grid=small_t)
    temps, biases = fit_sts_bias(fit_logits, fit_acc)
    assert len(temps) == len(biases) == gamma and all(isinstance(b, float) for b in temps + biases)
    # the standard errors of (1/T, b) at these sample sizes are below 0.05 (20,000 rows at position 1, fewer later)
    for k in range(gamma):
        assert 0.85 < temps[k] < 1.15 and -1.2 < biases[k] < -0.8, (k, temps, biases)
    test_logits, test_acc = _offset_synthetic(20000, gamma, seed=11)
    only = calibration_report(test_logits, test_acc, temps_only)
    both = calibration_report(test_logits, test_acc, temps, biases=biases)
    json.dumps(both)
    assert both["biases"] == pytest.approx(biases) and only["biases"] == [0.0] * gamma
    assert only["positions"][0]["ece_after"] > 0.03  # no temperature fixes an offset
    for p_only, p_both in zip(only["positions"], both["positions"]):
        assert p_both["ece_after"] < 0.02 and p_both["ece_after"] < p_only["ece_after"], (p_only, p_both)
        assert p_both["auroc"] == pytest.approx(p_only["auroc"], abs=1e-12)  # monotone: same ranking
    # a logit with no information: the slope is held at 1 / max_temperature (increasing map), the offset fits the rate
    rng = np.random.default_rng(12)
    noise = rng.normal(size=(20000, 1))
    flat_acc = (rng.random((20000, 1)) < 0.3).astype(float)
    t_flat, b_flat = fit_sts_bias(noise, flat_acc, max_temperature=20.0)
    assert t_flat[0] == pytest.approx(20.0)  # the likelihood wants no slope at all; the bound holds it
    assert float(np.mean(1 / (1 + np.exp(-(noise[:, 0] / t_flat[0] + b_flat[0]))))) == pytest.approx(0.3, abs=0.01)


def test_apply_sts_with_biases_and_errors():
    logits = np.array([[0.0, 2.0, -4.0]])
    out = apply_sts(logits, [1.0, 2.0, 4.0], [0.5, -1.0, 0.0])
    np.testing.assert_allclose(out, 1 / (1 + np.exp(-np.array([[0.5, 0.0, -1.0]]))))
    tt = apply_sts(torch.tensor(logits), [1.0, 2.0, 4.0], [0.5, -1.0, 0.0])
    np.testing.assert_allclose(tt.numpy(), out)
    with pytest.raises(ValueError, match="biases"):
        apply_sts(logits, [1.0, 2.0, 4.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="biases"):
        apply_sts(logits, [1.0, 2.0, 4.0], [0.0, float("nan"), 0.0])
    with pytest.raises(ValueError, match="max_temperature"):
        fit_sts_bias(logits, np.ones((1, 3)), max_temperature=0.0)
    with pytest.raises(ValueError, match="0/1"):
        fit_sts_bias(logits, np.full((1, 3), 0.5))
    with pytest.raises(ValueError, match="min_temperature"):
        fit_sts_bias(logits, np.ones((1, 3)), min_temperature=2.0, max_temperature=1.0)
    # a position that no block reaches keeps (1, 0)
    t_none, b_none = fit_sts_bias(np.zeros((4, 2)), np.zeros((4, 2)))
    assert t_none[1] == 1.0 and b_none[1] == 0.0


@pytest.mark.parametrize("case", ["separable", "three_rows", "all_accepted", "all_rejected", "huge_logits"])
def test_sts_bias_stays_bounded_on_degenerate_data(case):
    """Few, separable or one-class rows (late positions of a small calibration run) give a bounded temperature and
    a finite offset, never a step function: T in [0.05, 20], and a one-class position's confidence near Platt's
    smoothed rate (n+1)/(n+2) or 1/(n+2)."""
    rng = np.random.default_rng(3)
    x = {"separable": np.linspace(-3, 3, 40), "three_rows": np.array([1.0, 0.0, -1.0]),
         "all_accepted": rng.normal(size=30), "all_rejected": rng.normal(size=30),
         "huge_logits": rng.normal(size=200) * 1e4}[case]
    y = {"separable": (x > 0), "three_rows": np.array([1, 0, 0]), "all_accepted": np.ones(30),
         "all_rejected": np.zeros(30), "huge_logits": rng.random(200) < 0.3}[case].astype(float)
    temps, biases = fit_sts_bias(x[:, None], y[:, None])
    assert 0.05 - 1e-9 <= temps[0] <= 20.0 + 1e-9 and math.isfinite(biases[0]), (temps, biases)
    c = 0.5 * (1 + np.tanh(0.5 * (x / temps[0] + biases[0])))  # σ without overflow
    if case == "all_accepted":
        assert c.mean() == pytest.approx(31 / 32, abs=0.01)
    if case == "all_rejected":
        assert c.mean() == pytest.approx(1 / 32, abs=0.01)
    if case == "separable":  # Platt's targets keep it finite: steeper than the raw logit, centred on the boundary
        assert 0.05 < temps[0] < 1.0 and abs(biases[0]) < 1e-6
