"""SPS(B) profiling (`dspark.evaluation.profiling`, `dspark profile`): table structure, storage, loader interpolation
and errors, the generate() default, plots; `--dtype auto` (`dspark.evaluation.dtype`). Uses a tiny random target where
the model does not matter."""

from __future__ import annotations

import json
import time

import pytest
import torch

from dspark.evaluation import dtype as choice
from dspark.evaluation import profiling
from dspark.evaluation.profiling import SPSCurve, load_sps, monotone_sps

from .algorithm1 import prefix_schedule
from .conftest import make_drafter, tiny_target


# tiny forwards are dominated by thread synchronisation on a busy machine: one thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _profile_dir(tmp_path, monkeypatch):
    """Every test gets its own empty profile cache."""
    monkeypatch.setenv("DSPARK_PROFILE_DIR", str(tmp_path / "profiles"))


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(vocab_size=32)


@pytest.fixture(scope="module")
def measured_and_wall(tiny):
    """(a profile of the tiny target, the wall-clock seconds the call took, measured here)."""
    t0 = time.perf_counter()
    prof = profiling.profile_target(
        tiny, contexts=[8, 64], requests=[1, 2, 4], tokens=[1, 2, 3, 5], threads=1, warmup=1, repeats=3
    )
    return prof, time.perf_counter() - t0


@pytest.fixture(scope="module")
def measured(measured_and_wall):
    return measured_and_wall[0]


def test_profile_table_structure(tiny, measured, measured_and_wall):
    assert measured["model"] == profiling.target_name(tiny) == "llama-h32-l4-v32"
    assert measured["dtype"] == "float32" and measured["threads"] == 1
    assert set(measured["tables"]) == {8, 64}
    for ctx, per_r in measured["tables"].items():
        assert set(per_r) == {1, 2, 4}
        for r, table in per_r.items():
            assert sorted(table) == [r * q for q in (1, 2, 3, 5)]  # B = R x q
            rates = [table[b] for b in sorted(table)]
            assert all(a >= b for a, b in zip(rates, rates[1:])), "stored curve must be non-increasing in B"
            # the stored curve is the isotonic fit of the measured medians, at the same B
            assert table == pytest.approx(monotone_sps(measured["raw"][ctx][r]))
    assert measured["meta"]["repeats"] == 3
    assert 0 < measured["meta"]["seconds"] <= measured_and_wall[1] + 0.005  # within the call's (rounded to 10 ms)
    assert torch.get_num_threads() == 1  # restored


def test_measure_verify_times_each_verify_forward(tiny):
    """Each timed forward is one verify, in seconds: with every target forward made 20 ms slower, each time is at
    least 20 ms, and together they leave room in the call's wall time for the untimed prefills (one per request) and
    the warm-up pass (one forward per q)."""
    pause = 0.02
    hook = tiny.register_forward_hook(lambda *args: time.sleep(pause))
    try:
        t0 = time.perf_counter()
        times = profiling.measure_verify(tiny, requests=2, tokens=[1, 4], context_len=5, warmup=1, repeats=2)
        wall = time.perf_counter() - t0
    finally:
        hook.remove()
    assert set(times) == {1, 4} and all(len(v) == 2 for v in times.values())
    assert min(min(v) for v in times.values()) >= pause
    assert sum(map(sum, times.values())) <= wall - (2 + 2) * pause


def test_monotone_sps_is_isotonic():
    raw = {1: 10.0, 2: 12.0, 3: 8.0, 4: 9.0, 5: 5.0}  # two violations
    mono = monotone_sps(raw)
    vals = [mono[b] for b in sorted(mono)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    assert mono[5] == pytest.approx(5.0)
    # pooled step times are means of the violating blocks
    assert 1 / mono[1] == pytest.approx((1 / 10 + 1 / 12) / 2)
    assert monotone_sps({1: 5.0, 2: 4.0}) == {1: 5.0, 2: 4.0}


def test_curve_interpolates_and_raises():
    curve = SPSCurve({1: 100.0, 3: 50.0, 5: 25.0}, "test")
    assert curve(1) == 100.0 and curve(3) == 50.0 and curve[5] == 25.0
    assert curve(2) == pytest.approx(1 / ((0.01 + 0.02) / 2))  # linear in step time
    assert curve(4) == pytest.approx(1 / ((0.02 + 0.04) / 2))
    with pytest.raises(ValueError, match=r"B = 6 is outside the profiled range 1\.\.5"):
        curve(6)
    with pytest.raises(ValueError, match="outside"):
        curve(0)
    with pytest.raises(ValueError):
        SPSCurve({})
    with pytest.raises(ValueError):
        SPSCurve({1: -3.0})
    # usable by the scheduler as a callable
    assert prefix_schedule([[0.99, 0.99]], curve) == [2]  # Θ = 100, 1.99·66.7, 2.97·50: increasing


def test_save_load_roundtrip_and_loader(tiny, measured, tmp_path):
    path = profiling.save_profile(measured)
    assert path == profiling.default_profile_path() and path.exists()
    data = json.loads(path.read_text())
    node = data["profiles"]["llama-h32-l4-v32"]["float32"]["1"]
    assert set(node) == {"8", "64"} and set(node["8"]) == {"1", "2", "4"}
    assert set(node["8"]["2"]) == {"2", "4", "6", "10"}
    assert "raw_sps" in data["meta"]["llama-h32-l4-v32|float32|1|8|2"]

    sps = load_sps("llama-h32-l4-v32", torch.float32, 1, context_len=10)  # nearest bucket: 8
    table = measured["tables"][8][1]
    assert sps(1) == pytest.approx(table[1]) and sps(5) == pytest.approx(table[5])
    t3, t5 = 1 / table[3], 1 / table[5]
    assert sps(4) == pytest.approx(1 / ((t3 + t5) / 2))
    with pytest.raises(ValueError, match="outside the profiled range"):
        sps(6)
    far = load_sps("llama-h32-l4-v32", "float32", 1, context_len=1000)  # nearest bucket: 64
    assert far(2) == pytest.approx(measured["tables"][64][1][2])
    # R = 3 lies between measured R = 2 and 4: interpolated at equal tokens per request
    r3 = load_sps("llama-h32-l4-v32", "float32", 1, context_len=8, requests=3)
    assert sorted(r3.points) == [3, 6, 9, 15]
    lo, hi = measured["tables"][8][2][4], measured["tables"][8][4][8]
    assert r3(6) == pytest.approx(1 / ((1 / lo + 1 / hi) / 2))
    with pytest.raises(ValueError, match="no SPS profile for R = 8"):
        load_sps("llama-h32-l4-v32", "float32", 1, requests=8)
    with pytest.raises(FileNotFoundError, match="dspark profile"):
        load_sps("other-model", "float32", 1, 8)
    with pytest.raises(FileNotFoundError, match="bfloat16"):
        load_sps("llama-h32-l4-v32", "bfloat16", 1, 8)
    with pytest.raises(FileNotFoundError):
        load_sps("llama-h32-l4-v32", "float32", 1, 8, path=tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        load_sps("llama-h32-l4-v32", "float32", 1, 8, path=bad)

    # merging keeps other entries
    extra = dict(measured, threads=2, tables={8: {1: {1: 5.0, 2: 4.0}}}, raw={})
    profiling.save_profile(extra)
    assert load_sps("llama-h32-l4-v32", "float32", 2, 8)(2) == pytest.approx(4.0)
    assert load_sps("llama-h32-l4-v32", "float32", 1, 8)(1) == pytest.approx(table[1])


def test_profile_from_another_processor_is_not_used(tiny, measured, monkeypatch):
    """An SPS table is a property of the processor: one measured elsewhere (a copied cache) is refused by name, and
    re-profiling replaces it instead of mixing the two machines' tables."""
    assert measured["meta"]["cpu_model"] == profiling.cpu_model()
    profiling.save_profile(measured)
    assert load_sps("llama-h32-l4-v32", "float32", 1, 8)(1) == pytest.approx(measured["tables"][8][1][1])  # used
    monkeypatch.setattr(profiling, "cpu_model", lambda: "Other CPU 9000")
    with pytest.raises(FileNotFoundError, match="another processor.*Other CPU 9000"):
        load_sps("llama-h32-l4-v32", "float32", 1, 8)
    fresh = profiling.profile_target(tiny, contexts=[4], requests=[1], tokens=[1, 2, 3], threads=1, warmup=0,
                                     repeats=1)
    profiling.save_profile(fresh)
    assert set(profiling.load_profile("llama-h32-l4-v32", "float32", 1).tables) == {4}  # 8 and 64 are gone
    data = json.loads(profiling.default_profile_path().read_text())
    assert {m["cpu_model"] for k, m in data["meta"].items() if k.startswith("llama-h32-l4-v32|float32|1|")} == {
        "Other CPU 9000"}
    # a file written before processors were recorded: unknown processor, so not used either, and replaced on save
    for m in data["meta"].values():
        del m["cpu_model"]
    profiling.default_profile_path().write_text(json.dumps(data))
    with pytest.raises(FileNotFoundError, match="not recorded"):
        load_sps("llama-h32-l4-v32", "float32", 1, 4)
    profiling.save_profile(profiling.profile_target(tiny, contexts=[16], requests=[1], tokens=[1, 2], threads=1,
                                                    warmup=0, repeats=1))
    assert set(profiling.load_profile("llama-h32-l4-v32", "float32", 1).tables) == {16}


def test_cpu_model_names_the_flags_of_cpu_flags(monkeypatch):
    """The processor name carries the speed-relevant flags that :func:`modeling_dspark.target.cpu_flags` reads (the
    one /proc/cpuinfo flags parser), in the order of ``_CPU_FLAGS``, and the core count."""
    import os

    import modeling_dspark.target as target_mod

    def model_with(flags: set[str]) -> str:  # uncached: the session's processor name stays as first read
        monkeypatch.setattr(target_mod, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": frozenset(flags))
        return profiling.cpu_model.__wrapped__()

    cores = os.cpu_count() or 1
    assert model_with({"amx_bf16", "avx2", "fpu"}).endswith(f" [avx2 amx_bf16] x{cores}")
    plain = model_with({"fpu"})
    assert plain.endswith(f" x{cores}") and not plain.endswith(f"] x{cores}")


def test_timing_problem_spread_and_order():
    """The plausibility criterion of a measurement {B: [seconds, ...]}, on fake timings."""
    good = {1: [0.010, 0.011, 0.0105], 2: [0.011, 0.012, 0.0115], 5: [0.013, 0.014, 0.013]}
    assert profiling.timing_problem(good) is None
    assert profiling.timing_problem({1: [0.010, 0.0098, 0.0101], 2: [0.0095, 0.0097, 0.0096]}) is None  # within 25 %
    spread = {**good, 2: [0.011, 0.030, 0.012]}  # one repeat disturbed: (0.030 - 0.011) / 0.012 > 50 %
    assert "repeats at B=2 spread" in profiling.timing_problem(spread)
    order = {**good, 5: [0.006, 0.0061, 0.0062]}  # B=5 twice as fast as B=2
    assert "B=5 ran 47% faster than B=2" in profiling.timing_problem(order)  # 1 - 0.0061 / 0.0115


def test_scheduler_generate_greedy_identical_with_profiled_curve(tiny, measured):
    """The R = 1 scheduler in generate(), driven by a measured curve, keeps greedy output identical."""
    from dspark.generation import dspark_options
    from dspark.generation.stats import collect_stats

    drafter = make_drafter(tiny, block_size=4)
    curve = SPSCurve({b: 100.0 / (1 + 0.3 * b) for b in range(1, 6)})
    ids = torch.tensor([[3, 5, 7, 1]])
    ref = tiny.generate(ids, max_new_tokens=20, do_sample=False)
    with dspark_options(policy="scheduler", sps=curve), collect_stats() as runs:
        out = tiny.generate(ids, assistant_model=drafter, max_new_tokens=20, do_sample=False)
    assert torch.equal(out, ref)
    assert all(r.verified <= 4 for r in runs[-1].rounds)


def test_plot(measured, tmp_path, saved_figures):
    """One line per (context, R) curve in each panel: SPS(B) on the left, the step time 1000 / SPS(B) ms on the
    right; the PNG decodes at the figure's size (11 x 4.2 in at 110 dpi)."""
    import matplotlib.pyplot as plt

    profiling.save_profile(measured)
    prof = profiling.load_profile("llama-h32-l4-v32", "float32", 1)
    from dspark.cli.profile_cmd import plot_profile

    png = plot_profile(prof, tmp_path / "p.png")
    (fig,) = saved_figures
    sps_ax, ms_ax = fig.axes
    curves = [(ctx, r) for ctx in (8, 64) for r in (1, 2, 4)]
    assert [ln.get_label() for ln in sps_ax.get_lines()] == [f"ctx {c}, R={r}" for c, r in curves]
    for (ctx, r), sps, ms in zip(curves, sps_ax.get_lines(), ms_ax.get_lines()):
        table = measured["tables"][ctx][r]
        assert list(sps.get_xdata()) == sorted(table) == list(ms.get_xdata())
        assert list(sps.get_ydata()) == pytest.approx([table[b] for b in sorted(table)])
        assert list(ms.get_ydata()) == pytest.approx([1e3 / table[b] for b in sorted(table)])
    assert plt.imread(png).shape[:2] == (round(4.2 * 110), round(11 * 110))


def test_profile_cli(tmp_path, capsys, saved_figures):
    """`dspark profile` on the default target with a tiny measurement, then `--show`."""
    import matplotlib.pyplot as plt

    from dspark.cli.main import main

    out = tmp_path / "sps.json"
    rc = main(["profile", "--contexts", "4", "--tokens", "1", "2", "--repeats", "1", "--warmup", "0",
               "--threads", "1", "--dtype", "float32", "--out", str(out), "--json"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"] == "SmolLM2-135M-Instruct" and set(printed["tables"]["4"]["1"]) == {"1", "2"}
    # the plot next to the profile file draws the table printed: SPS(B) at B = 1, 2, and the step time in ms
    (fig,) = saved_figures
    table = {int(b): s for b, s in printed["tables"]["4"]["1"].items()}
    (sps,), (ms,) = (ax.get_lines() for ax in fig.axes)
    assert list(sps.get_xdata()) == list(ms.get_xdata()) == [1, 2]
    assert list(sps.get_ydata()) == pytest.approx([table[1], table[2]])
    assert list(ms.get_ydata()) == pytest.approx([1e3 / table[1], 1e3 / table[2]])
    assert plt.imread(tmp_path / "SmolLM2-135M-Instruct-float32-t1.png").shape[:2] == (462, 1210)
    assert main(["profile", "--show", "--threads", "1", "--dtype", "float32", "--out", str(out)]) == 0
    assert "R=1" in capsys.readouterr().out
    assert main(["profile", "--repeats", "0"]) == 2
    assert main(["profile", "--show", "--threads", "3", "--out", str(out)]) == 2


def test_generate_default_policy_prices_rounds(tiny):
    """generate(assistant_model=drafter) with no policy runs the scheduler: with an explicit table where nothing is
    worth verifying it verifies nothing, and with policy full every slot. Greedy output identical either way. The
    lookup proposer is off: its chains are priced by their own record."""
    from dspark.generation import dspark_options
    from dspark.generation.stats import collect_stats

    drafter = make_drafter(tiny, block_size=4)
    ids = torch.tensor([[3, 5, 7, 1]])
    ref = tiny.generate(ids, max_new_tokens=12, do_sample=False)

    def verified(**options):
        with dspark_options(lookup=False, **options), collect_stats() as runs:
            out = tiny.generate(ids, assistant_model=drafter, max_new_tokens=12, do_sample=False)
        assert torch.equal(out, ref)
        return [r.verified for r in runs[-1].rounds]

    steep = {b: (100.0 if b == 1 else 1.0) for b in range(1, 18)}  # nothing is ever worth verifying
    assert max(verified(sps=steep)) == 0
    assert max(verified(policy="full")) == 4


# ---------------------------------------------------------------------------------------------- auto dtype
def _fake_timing(monkeypatch, rates: dict[str, float]) -> list:
    """Replace the generate() timing with fixed tokens/s; returns the list of calls made."""
    calls = []
    monkeypatch.setattr(choice, "_time_generate", lambda *a: calls.append(a) or dict(rates))
    monkeypatch.setattr(choice, "_contention", lambda start, threads: 0.0)  # a quiet machine
    monkeypatch.setattr(choice, "_contended", {})  # no timing of this process kept yet
    return calls


@pytest.mark.real_auto_dtype
def test_auto_dtype_settled_by_the_processor_only_on_a_gpu(monkeypatch):
    """A GPU: bfloat16 with no timing run; every CPU (native bf16 or not) is measured."""
    calls = _fake_timing(monkeypatch, {"float32": 1.0, "bfloat16": 100.0})
    assert choice.auto_dtype(device="cuda")[0] == torch.bfloat16
    assert choice.auto_dtype(torch.nn.Linear(1, 1), device="cuda")[0] == torch.bfloat16  # nothing to load there
    assert calls == []
    assert choice.auto_dtype(threads=1)[0] == torch.bfloat16 and len(calls) == 1
    with pytest.raises(ValueError, match="repeats"):
        choice.auto_dtype(repeats=0)


@pytest.mark.real_auto_dtype
@pytest.mark.parametrize("fp32, bf16, expected", [(12.5, 19.6, torch.bfloat16),  # bf16 clearly faster
                                                   (17.5, 14.5, torch.float32),  # fp32 faster
                                                   (10.0, 10.4, torch.float32)])  # within the 5% margin
def test_auto_dtype_picks_the_faster_measured_dtype_and_caches_it(monkeypatch, fp32, bf16, expected):
    calls = _fake_timing(monkeypatch, {"float32": fp32, "bfloat16": bf16})
    dtype, why = choice.auto_dtype(None, None, threads=1)
    assert dtype == expected and f"bfloat16 {bf16:.1f} tok/s, float32 {fp32:.1f}" in why
    assert len(calls) == 1 and calls[0][0] is None and calls[0][1] is None  # the default target, plain decoding
    assert choice.auto_dtype(None, None, threads=1) == (dtype, why.replace(
        "measured on", f"measured before ({time.strftime('%Y-%m-%d')}) on"))
    assert len(calls) == 1  # cached beside the SPS profiles
    data = json.loads(profiling.default_profile_path().read_text())
    (key, entry), = data["dtype"].items()
    assert key.endswith("|plain|1|cpu") and entry["cpu_model"] == profiling.cpu_model()
    choice.auto_dtype(None, None, threads=2)  # another job (thread count): measured anew
    assert len(calls) == 2


@pytest.mark.real_auto_dtype
def test_auto_dtype_takes_a_drafter_by_name_folder_or_loaded_model_alike(monkeypatch):
    """A shipped drafter's name, its folder and the drafter loaded from it are one job: measured once, then cached."""
    from modeling_dspark import DSparkDraftModel
    from modeling_dspark.hub import shipped_drafter_dir

    calls = _fake_timing(monkeypatch, {"float32": 10.0, "bfloat16": 20.0})
    loaded = DSparkDraftModel.from_pretrained("smollm2-135m-dspark")
    for drafter in ("smollm2-135m-dspark", shipped_drafter_dir("smollm2-135m-dspark"), loaded):
        assert choice.auto_dtype(None, drafter, threads=1)[0] == torch.bfloat16
    assert len(calls) == 1
    with pytest.raises(ValueError, match="not loaded from a directory"):  # nothing auto_dtype could load again
        choice.auto_dtype(None, torch.nn.Linear(1, 1), threads=1)


@pytest.mark.real_auto_dtype
def test_auto_dtype_remeasures_on_another_processor_and_under_load(monkeypatch):
    """A cache entry from another processor is measured again; a timing during which other work took half a CPU or
    more from its threads (a thread sharing its core stalls every step) is kept for this process only, not cached."""
    calls = _fake_timing(monkeypatch, {"float32": 10.0, "bfloat16": 20.0})
    choice.auto_dtype(threads=1)
    monkeypatch.setattr(choice, "device_model", lambda device: "Other CPU 9000")
    choice.auto_dtype(threads=1)
    assert len(calls) == 2  # a cache entry from another processor is not used
    monkeypatch.setattr(choice, "_contention", lambda start, threads: 0.6)
    monkeypatch.setattr(choice, "device_model", lambda device: "Third CPU")
    dtype, why = choice.auto_dtype(threads=1)
    assert dtype == torch.bfloat16 and why.endswith("other work shared 0.6 of its CPUs meanwhile, so this is not "
                                                    "cached")
    dtype, why = choice.auto_dtype(threads=1)
    assert len(calls) == 3 and why.endswith("timed earlier in this process beside other work, so not cached")
    assert not any(k.endswith("|1|cpu") and v["cpu_model"] == "Third CPU"
                   for k, v in json.loads(profiling.default_profile_path().read_text())["dtype"].items())


def test_contention_is_other_work_beyond_the_cpus_the_threads_leave_free(monkeypatch):
    """Other work's CPUs over an interval are the CPUs' busy seconds less this process's, over the wall seconds (4 busy
    CPU-seconds in 2 s, 2 of them this process's: 1 CPU); on 2 CPUs that shares the CPUs of 2 threads, not of 1 (its
    other CPU is free); this process alone is never contention. A real reading is four numbers, the count >= 1."""
    wall, busy, own, cpus = choice._cpu_seconds()
    assert min(wall, busy, own) >= 0.0 and cpus >= 1
    readings = [(2.0, 14.0, 7.0, 2), (2.0, 14.0, 7.0, 2), (4.0, 14.0, 9.0, 2)]
    monkeypatch.setattr(choice, "_cpu_seconds", lambda: readings.pop(0))
    assert choice._contention((0.0, 10.0, 5.0, 2), threads=2) == pytest.approx(1.0)
    assert choice._contention((0.0, 10.0, 5.0, 2), threads=1) == 0.0
    assert choice._contention((0.0, 10.0, 5.0, 2), threads=2) == 0.0  # 4 busy CPU-seconds, all this process's


@pytest.mark.real_auto_dtype
def test_auto_dtype_times_the_real_job(monkeypatch):
    """The timing itself: greedy generate() of the default target in both dtypes, plain and with the shipped
    drafter, each dtype's rate the new tokens over the seconds of its fastest timed call. A clock whose k-th reading
    is 1 + 2 + ... + k makes every timed call last as long as the number of its closing reading: after the untimed
    warm-up (readings 1, 2), float32 is timed by readings 3-4 and 7-8, bfloat16 by 5-6 and 9-10."""
    from modeling_dspark.target import shipped_drafter_for

    class Clock:
        reads = 0

        @classmethod
        def perf_counter(cls) -> float:
            cls.reads += 1
            return cls.reads * (cls.reads + 1) / 2

    for drafter in (None, str(shipped_drafter_for())):
        Clock.reads = 0
        monkeypatch.setattr(choice, "time", Clock)
        rates = choice._time_generate(None, drafter, (torch.float32, torch.bfloat16), 3, 2, "cpu")
        monkeypatch.undo()
        assert rates == {"float32": 3 / 4, "bfloat16": 3 / 6}, drafter  # 3 new tokens each, the faster call kept
