"""The demo page: the functions behind it (no browser), one real end-to-end request, and a headless-Chromium test.

The browser test (``-m browser``) needs Debian's ``chromium`` and the python ``playwright`` package
(``scripts/install_browser.sh``); without them it is skipped with the reason, and fails under ``CI=true``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import importlib.util

import pytest

from .conftest import require

require(importlib.util.find_spec("gradio") is not None, "the app needs gradio: pip install -e '.[app]'")

import app  # noqa: E402
from dspark.generation.stats import GenerationStats, RoundStats  # noqa: E402
from dspark.app_render import (  # noqa: E402
    empty_position_counts,
    first_difference,
    position_chart_html,
    position_rows,
    round_views,
    rounds_html,
    summary_html,
    summary_rows,
    update_position_counts,
)

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("DSPARK_CHROMIUM", "/usr/bin/chromium")


# ---------------------------------------------------------------------------------------------- fixtures
def _stats():
    """Three rounds with γ' = 4: a rejection at k=2, a fully accepted ℓ=2 (cut at 2), and ℓ=0 (the drafter ran)."""
    return GenerationStats(rounds=[
        RoundStats(drafted=3, verified=3, accepted=1, committed=2, confidences=[0.9, 0.5, 0.5],
                   draft_tokens=[11, 12, 13], t_draft_ms=2.0, t_verify_ms=4.0),
        RoundStats(drafted=2, verified=2, accepted=2, committed=3, confidences=[0.8, 0.75],
                   draft_tokens=[21, 22], t_draft_ms=2.0, t_verify_ms=6.0),
        RoundStats(drafted=0, verified=0, accepted=0, committed=1, confidences=[], draft_tokens=[], ingested=1),
    ])


# output: prefill 10 | r1: 11 (accepted) 99 (resampled) | r2: 21 22 (accepted) 23 (bonus) | r3: 30 | last: 40
NEW_IDS = [10, 11, 99, 21, 22, 23, 30, 40]


def _kinds(view):
    return [(c.k, c.kind) for c in view.cells]


# ---------------------------------------------------------------------------------------------- token rows
def test_round_views_label_every_slot():
    views = round_views(_stats(), NEW_IDS, block_size=4, max_new_tokens=100, decode=lambda t: f"<{t}>")
    assert [v.index for v in views] == [0, 1, 2, 3, -1]
    prefill, r1, r2, r3, last = views
    assert _kinds(prefill) == [(0, "target")] and prefill.committed == [10]
    assert _kinds(r1) == [(1, "accepted"), (2, "rejected"), (3, "discarded"), (4, "cut"), (0, "resampled")]
    assert (r1.verified, r1.accepted, r1.committed) == (3, 1, [11, 99])
    assert _kinds(r2) == [(1, "accepted"), (2, "accepted"), (3, "cut"), (4, "cut"), (0, "bonus")]
    assert r2.cells[-1].token_id == 23
    assert _kinds(r3) == [(1, "cut"), (2, "cut"), (3, "cut"), (4, "cut"), (0, "bonus")]
    assert _kinds(last) == [(0, "target")] and last.committed == [40]
    assert all(v.consistent for v in views)
    # survival a_k = Π c_i; cut slots carry no confidence
    assert [round(c.survival, 6) for c in r1.cells[:3]] == [0.9, 0.45, 0.225]
    assert r2.cells[1].survival == pytest.approx(0.6)
    assert r1.cells[3].confidence is None and r1.cells[3].token_id is None
    assert sum(len(v.committed) for v in views) == len(NEW_IDS)


def test_round_views_mark_rounds_without_a_drafter_forward_skipped():
    """A round where the drafter did not run and nothing was verified shows its slots as skipped, not cut."""
    stats = _stats()
    stats.rounds[2].ingested = 0
    r3 = round_views(stats, NEW_IDS, block_size=4, max_new_tokens=100, decode=str)[3]
    assert _kinds(r3) == [(1, "skipped"), (2, "skipped"), (3, "skipped"), (4, "skipped"), (0, "bonus")]
    assert "∅" in rounds_html([r3])


def test_round_views_near_the_length_limit_and_at_eos():
    stats = GenerationStats(rounds=[RoundStats(drafted=2, verified=2, accepted=2, committed=3,
                                               confidences=[0.9, 0.9], draft_tokens=[5, 6])])
    # max_new_tokens = 4: after the prefill token only 4 - 1 - 1 = 2 slots fit, so nothing is cut
    (_, r1) = round_views(stats, [1, 5, 6, 7], block_size=8, max_new_tokens=4)
    assert r1.slots == 2 and [c.kind for c in r1.cells] == ["accepted", "accepted", "bonus"]
    # EOS as the last accepted draft: the output ends before the bonus token
    views = round_views(stats, [1, 5, 6], block_size=2, max_new_tokens=100)
    assert [c.kind for c in views[1].cells] == ["accepted", "accepted"] and views[1].committed == [5, 6]
    assert views[1].consistent
    assert round_views(stats, [], block_size=2, max_new_tokens=10) == []


def test_round_views_flags_inconsistent_stats():
    stats = GenerationStats(rounds=[RoundStats(drafted=1, verified=1, accepted=1, committed=2,
                                               confidences=[0.5], draft_tokens=[5])])
    views = round_views(stats, [1, 6, 7], block_size=1, max_new_tokens=10)
    assert views[1].consistent is False
    assert "⚠" in rounds_html(views)


def _lookup_stats():
    """r1 drafted (c = 0.9, 0.8; both accepted), r2 verified a lookup chain (no confidences; 3 of 3 accepted),
    r3..r5 without a drafter forward (one target step each); γ' = 3."""
    return GenerationStats(rounds=[
        RoundStats(drafted=2, verified=2, accepted=2, committed=3, confidences=[0.9, 0.8], draft_tokens=[11, 12],
                   source="draft"),
        RoundStats(drafted=0, verified=3, accepted=3, committed=4, draft_tokens=[21, 22, 23],
                   source="lookup"),
        *[RoundStats(drafted=0, verified=0, accepted=0, committed=1) for _ in range(3)],
    ])


LOOKUP_IDS = [10, 11, 12, 13, 21, 22, 23, 24, 31, 32, 33]


def test_lookup_rounds_are_drawn_apart_and_left_out_of_the_calibration_chart():
    views = round_views(_lookup_stats(), LOOKUP_IDS, block_size=3, max_new_tokens=100)
    assert [v.source for v in views] == ["", "draft", "lookup", "", "", ""]
    counts = update_position_counts(None, views)
    # only r1 counts: the lookup's three accepted tokens carry no a_k and would read as a miscalibrated head
    assert counts["rounds"] == 1 and counts["verified"] == [1, 1, 0] and counts["accepted"] == [1, 1, 0]
    rows = {(r["position"], r["series"]): r["rate"] for r in position_rows(counts)}
    assert rows[(2, "predicted a_k (mean)")] == pytest.approx(0.72) and rows[(2, "observed acceptance")] == 1.0
    page = rounds_html(views)
    assert "r2 lookup ℓ=3 n=3" in page and "r1 ℓ=2 n=2" in page
    assert page.count('dspark-accepted dspark-lookup"') == 3 + 1  # r2's three tokens + the legend's sample


def test_rounds_that_verified_nothing_collapse_into_one_row():
    views = round_views(_lookup_stats(), LOOKUP_IDS, block_size=3, max_new_tokens=100)
    page = rounds_html(views)
    assert page.count("dspark-round dspark-skiprow") == 1 and "r3–r5 ℓ=0" in page and "×3" in page
    row = page.split('dspark-round dspark-skiprow', 1)[1].split("</div>", 1)[0]
    assert row.count('class="dspark-tok dspark-cut"') == 1  # one mark, not a row of 3 empty slots per round
    assert all(f"★ {t}<" in row for t in (31, 32, 33))  # the target's token of each collapsed round


def test_marks_render_in_an_installed_font():
    """Every status mark has a glyph in some installed font (an empty box in the browser otherwise)."""
    import shutil

    from dspark.app_render import KINDS

    require(shutil.which("fc-list") is not None, "no fontconfig (fc-list) to ask")
    marks = {sym for sym, _ in KINDS.values()} | set("↵⇥␣⚠×")
    missing = [m for m in marks if not subprocess.run(["fc-list", f":charset={ord(m):x}", "family"],
                                                      capture_output=True, text=True).stdout.strip()]
    assert not missing, f"no installed font has {missing}"


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], []) is None


def test_position_counts_accumulate_per_session():
    views = round_views(_stats(), NEW_IDS, block_size=4, max_new_tokens=100)
    counts = update_position_counts(None, views)
    assert counts["rounds"] == 2  # the drafted rounds: r3 verified nothing
    assert counts["verified"] == [2, 2, 1, 0] and counts["accepted"] == [2, 1, 0, 0]
    assert counts["predicted"][0] == pytest.approx(0.9 + 0.8)
    again = update_position_counts(counts, views)
    assert again["verified"] == [4, 4, 2, 0] and counts["verified"] == [2, 2, 1, 0]  # input not modified
    rows = position_rows(again)
    observed = {r["position"]: r["rate"] for r in rows if r["series"] == "observed acceptance"}
    assert observed == {1: 1.0, 2: 0.5, 3: 0.0}
    assert position_rows(empty_position_counts()) == []
    chart = position_chart_html(again)
    assert chart.count("<rect") == len(rows) and "k=3" in chart and "k=4" not in chart and "3 rounds" not in chart
    assert "4 drafted rounds" in chart and "<title>k=2 observed acceptance: 0.500 over 4 rounds</title>" in chart
    assert "No rounds yet" in position_chart_html(None)


def test_rounds_html_shows_marks_confidences_and_escapes():
    views = round_views(_stats(), NEW_IDS, block_size=4, max_new_tokens=100,
                        decode=lambda t: {11: "<b>x</b>", 12: "\n", 99: " "}.get(t, f"t{t}"))
    page = rounds_html(views)
    for kind in ("accepted", "rejected", "discarded", "cut", "resampled", "bonus", "target"):
        assert f"dspark-{kind}" in page
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page
    assert "↵" in page and "␣" in page
    assert "r1 ℓ=3 n=1" in page and "r3 ℓ=0" in page and "3 rounds" in page
    assert "c 0.90 · a 0.90" in page and "c 0.50 · a 0.45" in page
    assert "hsl(108" in page  # c = 0.9 is green-ish


def test_summary_numbers_and_html():
    views = round_views(_stats(), NEW_IDS, block_size=4, max_new_tokens=100)
    s = summary_rows(views, len(NEW_IDS), 2.0, baseline_tokens=8, baseline_seconds=4.0)
    assert s["rounds"] == 3 and s["tau"] == pytest.approx(6 / 3)
    assert s["mean_verify_length"] == pytest.approx(5 / 3) and s["acceptance_rate"] == pytest.approx(3 / 5)
    assert s["tokens_per_s"] == 4.0 and s["baseline_tokens_per_s"] == 2.0 and s["speedup"] == 2.0
    page = summary_html(s, note="hello", note_class="dspark-ok")
    assert "2.00×" in page and "τ" in page and "hello" in page
    assert "–" in summary_html(summary_rows([], 0, 0.0))  # no rounds: dashes, no division by zero


# ---------------------------------------------------------------------------------------------- request bounds
@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": "   "}, "Empty prompt"),
    ({"prompt": None}, "Empty prompt"),
    ({"prompt": "x" * (app.MAX_PROMPT_CHARS + 1)}, "Prompt too long"),
    ({"max_new_tokens": 0}, "max new tokens"),
    ({"max_new_tokens": app.MAX_NEW_TOKENS + 1}, "max new tokens"),
    ({"max_new_tokens": "many"}, "must be a number"),
    ({"max_new_tokens": 2.5}, "whole number"),
    ({"decoding": "beam"}, "decoding"),
    ({"decoding": "sampling", "temperature": 0}, "temperature"),
    ({"decoding": "sampling", "top_p": 0}, "top-p"),
    ({"temperature": float("nan")}, "finite"),
    ({"seed": -1}, "seed"),
    ({"block_size": 0}, "block size"),
    ({"dtype": "float16"}, "dtype"),
    ({"policy": "bogus"}, "verify policy"),
    ({"policy": "fixed:-1"}, "verify policy"),
    ({"drafter": "/no/such/drafter"}, "drafter directory not found"),
])
def test_validate_request_rejects_with_a_clear_message(kwargs, message):
    args = {"prompt": "Hi", **kwargs}
    with pytest.raises(app.AppError, match=message):
        app.validate_request(**args)


def test_validate_request_resolves_a_shipped_drafter_by_name():
    from modeling_dspark.hub import shipped_drafter_dir

    assert app.validate_request("Hi", drafter="smollm2-135m-dspark").drafter == str(
        shipped_drafter_dir("smollm2-135m-dspark"))


def test_validate_request_accepts_page_values():
    req = app.validate_request("Hi", 12.0, "sampling", 0.7, 0.9, 3.0, 4.0, "threshold:0.5", "bfloat16", "")
    assert req == app.Request("Hi", 12, True, 0.7, 0.9, 3, 4, "threshold:0.5", "bfloat16", "random")
    assert app.validate_request("Hi", block_size=None).block_size is None
    assert app.validate_request("Hi", policy=" scheduler ").policy == "scheduler"
    for spec in app.POLICY_CHOICES:  # every dropdown entry is a spec of the one policy vocabulary
        assert app.validate_request("Hi", policy=spec).policy == spec


@pytest.mark.real_auto_dtype
def test_auto_dtype_follows_the_timing(monkeypatch, tmp_path):
    from dspark.evaluation import dtype as choice

    monkeypatch.setenv("DSPARK_PROFILE_DIR", str(tmp_path))
    monkeypatch.setattr(choice, "_contention", lambda start, threads: 0.0)
    monkeypatch.setattr(choice, "_time_generate", lambda *a: {"float32": 10.0, "bfloat16": 15.0})
    assert app.auto_dtype()[0] == "bfloat16" and app.validate_request("Hi", dtype="auto").dtype == "bfloat16"
    monkeypatch.setenv("DSPARK_PROFILE_DIR", str(tmp_path / "other"))
    monkeypatch.setattr(choice, "_time_generate", lambda *a: {"float32": 15.0, "bfloat16": 10.0})
    assert app.auto_dtype()[0] == "float32" and app.validate_request("Hi", dtype="auto").dtype == "float32"


class _Tok:
    chat_template = None
    pad_token_id, eos_token_id = 0, 0

    def __call__(self, text):
        return {"input_ids": list(range(len(text.split())))}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids)


def test_encode_prompt_bounds_tokens():
    assert app.encode_prompt(_Tok(), "a b c").tolist() == [[0, 1, 2]]
    with pytest.raises(app.AppError, match="3 tokens .* limit is 2"):
        app.encode_prompt(_Tok(), "a b c", limit=2)


def test_compare_note_cases():
    req = app.Request("Hi")
    decode = lambda t: f"t{t}"  # noqa: E731
    note, cls = app.compare_note([1, 2, 3], [1, 2, 3], req, decode)
    assert "Identical" in note and cls == "dspark-ok"
    note, cls = app.compare_note([1, 2, 3], [1, 5, 3], req, decode)
    assert "bug" in note and cls == "dspark-bad"
    bf16 = app.Request("Hi", dtype="bfloat16")
    tie = {"ids": [2, 5], "logits": [16.0, 15.95], "gap": 0.05, "bf16_spacing": 0.125}
    note, cls = app.compare_note([1, 2, 3], [1, 5, 3], bf16, decode, tie)
    assert "first 1 tokens" in note and "token 2" in note and "near-tie" in note and "batched" in note
    note, _ = app.compare_note([1, 2], [1, 3], app.Request("Hi", do_sample=True), decode)
    assert "distribution" in note


# ---------------------------------------------------------------------------------------------- failures
class _FakeBank(app.ModelBank):
    def __init__(self, models):
        super().__init__(default_drafter="random")
        self.models = models

    def get(self, dtype="float32", drafter=None):
        return self.models


def _fake_models(generate, block_size=4):
    target = SimpleNamespace(generate=generate, device="cpu")
    drafter = SimpleNamespace(config=SimpleNamespace(block_size=block_size))
    return app.Models(target, _Tok(), drafter, "fake", "")


def test_generation_error_is_reported_not_hung():
    def boom(*a, **k):
        raise RuntimeError("out of memory (test)")

    bank = _FakeBank(_fake_models(boom))
    t0 = time.monotonic()
    with pytest.raises(app.AppError, match="DSpark generation failed: RuntimeError: out of memory"):
        list(app.run_demo(bank, app.Request("a b")))
    assert time.monotonic() - t0 < 10
    assert bank.lock.acquire(blocking=False)  # released


def test_request_checks_against_the_loaded_drafter():
    bank = _FakeBank(_fake_models(lambda *a, **k: None, block_size=4))
    with pytest.raises(app.AppError, match="between 1 and 4"):
        list(app.run_demo(bank, app.Request("a b", block_size=8)))
    with pytest.raises(app.AppError, match="scheduler is not available: this drafter has no confidence head"):
        list(app.run_demo(bank, app.Request("a b", policy="scheduler")))


def test_closing_the_page_cancels_the_worker():
    seen = {}

    def slow_generate(ids, streamer=None, stopping_criteria=None, **kw):
        streamer.on_finalized_text("first words")  # the page now shows text; the worker goes on
        for _ in range(500):  # 50 s unless stopped
            if stopping_criteria[0](ids, None).all():
                seen["stopped"] = True
                break
            time.sleep(0.1)
        streamer.end()
        return ids

    bank = _FakeBank(_fake_models(slow_generate))
    events = app.run_demo(bank, app.Request("a b"))
    for what, _ in events:
        if what == "spec_text":
            break
    t0 = time.monotonic()
    events.close()  # what gradio does when the user leaves or presses Stop
    assert time.monotonic() - t0 < 5 and seen.get("stopped")

    # the time limit stops a generation the same way
    ids = app.torch.tensor([[1, 2]])
    result = list(app.stream_generate(_fake_models(slow_generate), ids, app.Request("a b"), False,
                                      timeout_s=0.3))[-1]
    assert result.stopped and result.error is None
    assert bank.lock.acquire(blocking=False)


# ---------------------------------------------------------------------------------------------- real models
@pytest.fixture(scope="module")
def bank():
    """The real default target (fp32) and a random drafter, loaded once for this module."""
    return app.ModelBank(default_drafter="random")


def test_one_real_request_fp32_greedy_identical(bank):
    req = app.validate_request("What is the capital of France?", 6, block_size=4)
    events = list(app.run_demo(bank, req))
    kinds = [w for w, _ in events]
    assert "spec_text" in kinds and "base_text" in kinds and kinds[-1] == "done"
    out = events[-1][1]
    assert out.spec.new_ids == out.base.new_ids and 1 <= len(out.spec.new_ids) <= 6
    assert sum(len(v.committed) for v in out.views) == len(out.spec.new_ids)
    assert all(v.consistent for v in out.views)
    assert all(v.verified <= 4 for v in out.views)
    assert "Identical outputs" in out.summary_html and "dspark-round" in out.rounds_html
    assert out.counts["rounds"] == sum(v.source == "draft" for v in out.views)  # the chart: drafted rounds only
    s = out.summary  # identical outputs: the speed-up is the inverse ratio of the two runs' seconds
    assert s["speedup"] == pytest.approx(out.base.seconds / out.spec.seconds)


def test_real_request_with_the_scheduler(bank):
    """The page's scheduler (the default policy) prices its rounds on this machine: every round is consistent (the
    slots it verified are those it drafted, cut where it stopped) and the summary names the policy."""
    req = app.validate_request("Name a color.", 8, policy="scheduler")
    out = list(app.run_demo(bank, req, compare=False))[-1][1]
    rounds = [v for v in out.views if v.index > 0]
    assert rounds and all(v.consistent for v in out.views)
    assert all(v.verified <= v.slots for v in rounds)
    assert "verify policy: scheduler" in out.summary_html


# ---------------------------------------------------------------------------------------------- browser
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"app.py exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"app.py did not answer at {url} within {timeout:.0f} s")


@pytest.mark.browser
def test_browser_submit_prompt_renders_tokens_and_stats(tmp_path):
    require(Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK),
            f"no chromium at {CHROMIUM} (run scripts/install_browser.sh)")
    require(importlib.util.find_spec("playwright") is not None,
            "the python package 'playwright' is not installed (run scripts/install_browser.sh)")
    from playwright.sync_api import sync_playwright

    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    log = tmp_path / "app.log"
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with log.open("w") as logf:
        proc = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--port", str(port), "--no-warmup",
                                 "--dtype", "float32"],
                                cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT)
    try:
        try:
            _wait_http(url, proc, timeout=45)
        except (RuntimeError, TimeoutError) as err:
            pytest.fail(f"{err}\n--- app log ---\n{log.read_text()[-3000:]}")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM,
                headless=True,
                args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync", "--no-first-run"],
            )
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(url, wait_until="domcontentloaded")
                # --dtype float32 was given: the page says so and times no dtype at start
                assert "set with --dtype float32" in page.locator("#dspark-dtype").inner_text()
                page.locator("#dspark-prompt textarea").fill("Explain speculative decoding in one sentence.")
                max_new = page.locator("#dspark-max-new input[type=number]")
                max_new.fill("16")
                max_new.press("Enter")
                page.locator("#dspark-run").click()
                page.wait_for_selector("#dspark-rounds .dspark-round[data-round='1']", timeout=60_000)
                page.wait_for_selector("#dspark-summary table", timeout=10_000)
                summary = page.locator("#dspark-summary").inner_text()
                assert "τ" in summary and "speedup" in summary and "tok/s" in summary
                assert "Identical outputs" in summary
                rounds = page.locator("#dspark-rounds").inner_text()
                assert "ℓ=" in rounds and "prefill" in rounds
                # the dropdown starts at the scheduler where an SPS(B) table is cached for this machine, else full
                assert "verify policy: scheduler" in summary or "verify policy: full" in summary
                assert page.locator("#dspark-rounds .dspark-tok").count() > 3
                assert page.locator("#dspark-out textarea").input_value().strip()
                assert page.locator("#dspark-base textarea").input_value().strip()
                assert "Done" in page.locator("#dspark-status textarea").input_value()
                assert page.locator("#dspark-chart svg rect").count() >= 2  # observed + predicted at k=1
                out_dir = REPO / "test-output"
                out_dir.mkdir(exist_ok=True)
                page.screenshot(path=str(out_dir / "app.png"), full_page=True)
            finally:
                browser.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
