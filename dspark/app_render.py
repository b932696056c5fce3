"""Turn the per-round statistics of one DSpark `generate()` call into token rows and HTML.

Pure python (no UI toolkit): the Gradio page (``app.py``) and the tests call these functions, and
anything else that wants to show a speculative round can too.

A round, as :class:`~dspark.generation.stats.RoundStats` records it, drafted ℓ tokens (the verify policy stopped
drafting where it stopped verifying), the target accepted the first n of them, and one more token came from the
target: a *bonus* token when all ℓ were accepted, else the target's *resampled* token (under greedy decoding:
its correction) in place of the first rejected draft. :func:`round_views` lines these records up with the
generated token ids and labels every slot of every round:

=============  ==========================================================================================
``accepted``   drafted, verified, accepted (k ≤ n)
``rejected``   drafted, verified, the first draft the target did not accept (k = n + 1)
``discarded``  drafted and verified, but after a rejected one, so thrown away (k > n + 1)
``cut``        not verified: the policy stopped at ℓ < γ' (in DSpark it is then not drafted either)
``skipped``    not drafted: the drafter did not run this round and nothing was verified (no room left, or not
               even drafts certain to be accepted would have been verified)
``resampled``  the target's token that replaced the rejected draft
``bonus``      the target's extra token after a fully accepted round (or a round with ℓ = 0)
``target``     a token from a target step that is not a speculative round (the prefill, the last step)
=============  ==========================================================================================

A round verifies one chain (:attr:`RoundView.source`): the drafter's block, or the n-gram lookup's continuation
(:mod:`dspark.generation.lookup`; copied text, no confidences), drawn with an amber background and a "lookup" label.
Consecutive rounds that verified nothing (the drafter skipped, one target step each) are drawn as one row.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "KINDS",
    "TokenCell",
    "RoundView",
    "round_views",
    "first_difference",
    "empty_position_counts",
    "update_position_counts",
    "position_rows",
    "position_chart_html",
    "confidence_colour",
    "legend_html",
    "rounds_html",
    "summary_rows",
    "summary_html",
]

# the marks are characters of DejaVu Sans Mono (the monospace font every Debian browser has): none renders as an
# empty box
KINDS = {
    "accepted": ("✓", "accepted: drafted, verified and accepted by the target"),
    "rejected": ("✗", "rejected: the first drafted token the target did not accept"),
    "discarded": ("–", "discarded: verified, but after a rejected token"),
    "cut": ("✂", "not verified: cut by the scheduler (never drafted)"),
    "skipped": ("∅", "not drafted: the drafter did not run this round (nothing would have been verified)"),
    "resampled": ("↻", "resampled: the target's token in place of the rejected one (greedy: its correction)"),
    "bonus": ("★", "bonus: the target's extra token after a fully accepted round"),
    "target": ("•", "target step outside a speculative round (prefill / last step)"),
}


@dataclass
class TokenCell:
    """One slot of one round.

    Attributes:
        k: the draft slot (1-based, ``1..γ'``); ``0`` for a token that came from the target.
        kind: one of :data:`KINDS`.
        token_id: the token, or None for a cut slot.
        text: the decoded token ("" for a cut slot).
        confidence: calibrated c_k (None when unknown: cut slots, target tokens, drafters without a confidence
            head).
        survival: a_k = Π_{i≤k} c_i, the predicted probability that x_1..x_k all survive (None when unknown).
    """

    k: int
    kind: str
    token_id: int | None = None
    text: str = ""
    confidence: float | None = None
    survival: float | None = None


@dataclass
class RoundView:
    """One speculative round, ready to display.

    Attributes:
        index: 1-based round number (0 for the prefill row, -1 for a trailing non-speculative step).
        slots: draft slots the round could use, ``min(γ', tokens left − 1)``.
        verified: ℓ, the verify length the policy chose (= drafted tokens).
        accepted: n, drafted tokens the target accepted.
        committed: the token ids this round appended to the output.
        cells: :class:`TokenCell` per slot, then the target's token.
        consistent: whether the accepted drafts equal the committed output tokens (a sanity check).
        source: the chain verified: ``"draft"`` (the drafter's block), ``"lookup"`` (the n-gram lookup's
            continuation) or ``""`` (nothing verified; also the prefill and trailing rows).
    """

    index: int
    slots: int
    verified: int
    accepted: int
    committed: list[int] = field(default_factory=list)
    cells: list[TokenCell] = field(default_factory=list)
    t_draft_ms: float = 0.0
    t_verify_ms: float = 0.0
    consistent: bool = True
    source: str = ""

    @property
    def not_drafted(self) -> bool:
        """A speculative round that verified nothing: one target step (drawn collapsed by :func:`rounds_html`)."""
        return self.index > 0 and self.verified == 0


def round_views(
    stats,
    new_ids: Sequence[int],
    block_size: int,
    max_new_tokens: int,
    decode: Callable[[int], str] = str,
) -> list[RoundView]:
    """Line up the rounds of one DSpark `generate()` call with its output and label every slot.

    Args:
        stats: the call's :class:`~dspark.generation.stats.GenerationStats` (anything with ``.rounds``).
        new_ids: the generated token ids (without the prompt).
        block_size: γ', the draft slots per round the call used.
        max_new_tokens: the call's ``max_new_tokens`` (the last rounds may have fewer slots).
        decode: token id → display text.

    Returns:
        A prefill row (index 0, the first token, which the target's prefill forward produced), one
        :class:`RoundView` per round, and a trailing row (index -1) for any tokens after the last round (the last
        step of a call has no room to draft).
    """
    new_ids = [int(t) for t in new_ids]
    views: list[RoundView] = []
    if not new_ids:
        return views
    views.append(RoundView(0, 0, 0, 0, new_ids[:1], [TokenCell(0, "target", new_ids[0], decode(new_ids[0]))]))
    p = 1  # tokens generated so far
    for i, r in enumerate(stats.rounds, start=1):
        if p >= len(new_ids):
            break
        slots = max(0, min(block_size, max_new_tokens - p - 1))
        ell, n = int(r.verified), int(r.accepted)
        drafts = [int(t) for t in r.draft_tokens][:ell]
        confs = [float(c) for c in r.confidences][:ell]
        surv = torch.tensor(confs, dtype=torch.float64).cumprod(dim=0).tolist()  # a_k = Π_{j≤k} c_j (eq. 9)
        cells = []
        for k in range(1, ell + 1):
            kind = "accepted" if k <= n else ("rejected" if k == n + 1 else "discarded")
            tok = drafts[k - 1] if k - 1 < len(drafts) else None
            cells.append(TokenCell(
                k, kind, tok, decode(tok) if tok is not None else "?",
                confs[k - 1] if k - 1 < len(confs) else None,
                surv[k - 1] if k - 1 < len(surv) else None,
            ))
        gap = "skipped" if ell == 0 and not getattr(r, "ingested", 0) else "cut"
        for k in range(ell + 1, max(slots, ell) + 1):
            cells.append(TokenCell(k, gap))
        committed = new_ids[p : p + max(1, int(r.committed))]
        if len(committed) > n:  # the target's own token (may be missing when EOS / length ended the call)
            tok = committed[n]
            cells.append(TokenCell(0, "bonus" if n >= ell else "resampled", tok, decode(tok)))
        consistent = committed[:n] == drafts[: min(n, len(committed))]
        source = (getattr(r, "source", "") or "draft") if ell else ""  # records without a source: the drafter's
        views.append(RoundView(i, slots, ell, n, committed, cells, float(r.t_draft_ms), float(r.t_verify_ms),
                               consistent, source))
        p += len(committed)
    if p < len(new_ids):
        rest = new_ids[p:]
        views.append(RoundView(-1, 0, 0, 0, rest, [TokenCell(0, "target", t, decode(t)) for t in rest]))
    return views


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (incl. one ending first), or None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if int(x) != int(y):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------------------------------------- session chart
def empty_position_counts(block_size: int = 0) -> dict:
    """Per-position tallies for a session, over the rounds that verified the drafter's block: rounds that verified
    slot k, that accepted it, Σ a_k predicted, and the number of such rounds."""
    return {"verified": [0] * block_size, "accepted": [0] * block_size, "predicted": [0.0] * block_size,
            "rounds": 0}


def update_position_counts(counts: dict | None, views: Sequence[RoundView]) -> dict:
    """Return new tallies = ``counts`` + the rounds in ``views`` that verified the drafter's block (``counts`` is
    not modified). Lookup rounds are left out: their tokens carry no confidence, so counting them would compare the
    drafter's predicted a_k with the lookup's acceptance."""
    counts = counts or empty_position_counts()
    out = {key: list(counts[key]) for key in ("verified", "accepted", "predicted")}
    out["rounds"] = int(counts.get("rounds", 0))
    for v in views:
        if v.source != "draft":
            continue
        out["rounds"] += 1
        need = max(v.slots, v.verified)
        for key, fill in (("verified", 0), ("accepted", 0), ("predicted", 0.0)):
            out[key] += [fill] * (need - len(out[key]))
        for c in v.cells:
            if c.k == 0 or c.kind in ("cut", "skipped"):
                continue
            out["verified"][c.k - 1] += 1
            out["accepted"][c.k - 1] += c.kind == "accepted"
            if c.survival is not None:
                out["predicted"][c.k - 1] += c.survival
    return out


def position_rows(counts: dict) -> list[dict]:
    """Rows for a bar chart: per slot k, the observed acceptance rate (accepted / verified at k) and, when the
    drafter has a confidence head, the mean predicted survival a_k over the same rounds."""
    rows = []
    for k, (ver, acc, pred) in enumerate(zip(counts["verified"], counts["accepted"], counts["predicted"]), start=1):
        if ver == 0:
            continue
        rows.append({"position": k, "series": "observed acceptance", "rate": acc / ver, "rounds": ver})
        if pred > 0:
            rows.append({"position": k, "series": "predicted a_k (mean)", "rate": pred / ver, "rounds": ver})
    return rows


# ---------------------------------------------------------------------------------------------- HTML
def confidence_colour(value: float | None) -> str:
    """Background colour for a probability: red (0) → yellow (0.5) → green (1); grey when unknown."""
    if value is None:
        return "#e5e7eb"
    v = min(1.0, max(0.0, float(value)))
    return f"hsl({round(120 * v)}, 75%, 82%)"


_CSS = """
<style>
.dspark-legend{display:flex;flex-wrap:wrap;gap:6px 14px;font-size:12px;margin:4px 0 10px}
.dspark-legend .dspark-tok{min-width:0}
.dspark-scale{display:inline-block;width:120px;height:10px;vertical-align:middle;border-radius:3px;
 background:linear-gradient(90deg,hsl(0,75%,82%),hsl(60,75%,82%),hsl(120,75%,82%))}
.dspark-round{display:flex;align-items:flex-start;gap:4px;margin:3px 0;flex-wrap:wrap}
.dspark-rlabel{font:11px monospace;color:#555;width:116px;flex:none;padding-top:6px}
.dspark-tok{display:inline-flex;flex-direction:column;align-items:center;min-width:34px;padding:2px 4px 1px;
 border-radius:5px;border:2px solid transparent;font-size:12px;line-height:1.25;color:#111}
.dspark-tok .t{font-family:monospace;white-space:pre;font-size:13px}
.dspark-tok .m{font-size:9px;color:#333;font-family:monospace}
.dspark-tok .bar{height:3px;background:#2563eb;align-self:flex-start;border-radius:2px}
.dspark-accepted{border-color:#15803d}
.dspark-rejected{border-color:#b91c1c}.dspark-rejected .t{text-decoration:line-through}
.dspark-discarded{border-color:#b91c1c;border-style:dotted;opacity:.55}.dspark-discarded .t{text-decoration:line-through}
.dspark-cut,.dspark-skipped{border:2px dashed #9ca3af;background:#f3f4f6 !important;color:#9ca3af}
.dspark-resampled{border-color:#7c3aed;background:#ede9fe !important}
.dspark-bonus{border-color:#0369a1;background:#e0f2fe !important}
.dspark-target{border-color:#6b7280;background:#f9fafb !important}
.dspark-lookup{background:#fde68a !important;outline:1px solid #d97706}
.dspark-skiprow .dspark-rlabel{color:#9ca3af}
.dspark-sep{width:1px;align-self:stretch;background:#d1d5db;margin:0 3px}
.dspark-summary table{border-collapse:collapse;font-size:13px}
.dspark-summary td,.dspark-summary th{padding:2px 10px;border-bottom:1px solid #e5e7eb;text-align:left}
.dspark-note{font-size:13px;margin-top:6px;padding:6px 8px;border-radius:6px;background:#fef9c3}
.dspark-ok{background:#dcfce7}.dspark-bad{background:#fee2e2}
</style>
"""


def _show(text: str) -> str:
    text = text.replace("\n", "↵").replace("\t", "⇥").replace("\r", "")
    return html.escape(text if text.strip() or not text else text.replace(" ", "␣"))


def _cell_html(c: TokenCell, source: str = "") -> str:
    """One slot; ``source="lookup"`` marks a proposed token as the lookup's (amber, no confidence)."""
    sym, title = KINDS[c.kind]
    if c.kind in ("cut", "skipped"):
        tip = f"k={c.k}: {title}"
        return (f'<span class="dspark-tok dspark-cut" title="{html.escape(tip)}"><span class="t">{sym}</span>'
                f'<span class="m">k={c.k}</span></span>')
    tip = f"{title}; token id {c.token_id}"
    meta = ""
    if c.confidence is not None:
        tip += f"; c_{c.k}={c.confidence:.3f}, a_{c.k}={c.survival:.3f}"
        meta = f'<span class="m">c {c.confidence:.2f} · a {c.survival:.2f}</span>'
    elif c.k > 0:
        meta = f'<span class="m">k={c.k}</span>'
    bar = f'<span class="bar" style="width:{100 * c.survival:.0f}%"></span>' if c.survival is not None else ""
    bg = confidence_colour(c.confidence) if c.k > 0 else "#ffffff"
    lookup = c.k > 0 and source == "lookup"
    if lookup:
        tip = "proposed by the n-gram lookup (copied text, no confidence); " + tip
    return (f'<span class="dspark-tok dspark-{c.kind}{" dspark-lookup" if lookup else ""}" style="background:{bg}" '
            f'title="{html.escape(tip)}">'
            f'<span class="t">{sym} {_show(c.text)}</span>{meta}{bar}</span>')


def legend_html() -> str:
    """The legend: status marks and the colour scale."""
    items = "".join(
        f'<span><span class="dspark-tok dspark-{kind}"><span class="t">{sym}</span></span> {html.escape(text)}</span>'
        for kind, (sym, text) in KINDS.items()
    )
    items += ('<span><span class="dspark-tok dspark-accepted dspark-lookup"><span class="t">✓</span></span> '
              'amber: proposed by the n-gram lookup (copied text, no confidence)</span>')
    return (f'<div class="dspark-legend">{items}<span>background = calibrated confidence c_k '
            f'<span class="dspark-scale"></span> 0 → 1; blue bar = survival a_k = Π c_i</span></div>')


def _row(index: int, label: str, cells: Sequence[str], extra_class: str = "") -> str:
    return (f'<div class="dspark-round{extra_class}" data-round="{index}"><span class="dspark-rlabel">{label}</span>'
            f'{"".join(cells)}</div>')


def rounds_html(views: Sequence[RoundView], max_rounds: int = 400) -> str:
    """HTML of all rounds: one line per round with its slots, its verify length ℓ and its accepted count (a lookup
    round labelled "lookup", its tokens amber); a run of consecutive rounds that verified nothing is one line with
    one ∅ (or ✂) mark and their target tokens."""
    rows = []
    spec = [v for v in views if v.index > 0]
    shown = list(views[: max_rounds + 2])
    i = 0
    while i < len(shown):
        v = shown[i]
        if v.not_drafted:
            j = i
            while j + 1 < len(shown) and shown[j + 1].not_drafted:
                j += 1
            run = shown[i : j + 1]
            gap = "skipped" if any(c.kind == "skipped" for w in run for c in w.cells) else "cut"
            sym, title = KINDS[gap]
            what = f"{len(run)} round{'s' if len(run) > 1 else ''} verified no draft (one target step each); {title}"
            label = f"r{v.index}" + (f"–r{run[-1].index}" if len(run) > 1 else "") + " ℓ=0"
            mark = (f'<span class="dspark-tok dspark-cut" title="{html.escape(what)}"><span class="t">{sym}</span>'
                    f'<span class="m">×{len(run)}</span></span>')
            target = [_cell_html(c) for w in run for c in w.cells if c.k == 0]
            rows.append(_row(v.index, label, [mark, '<span class="dspark-sep"></span>', *target], " dspark-skiprow"))
            i = j + 1
            continue
        if v.index == 0:
            label = "prefill"
        elif v.index < 0:
            label = "last step"
        else:
            label = f"r{v.index}{' lookup' if v.source == 'lookup' else ''} ℓ={v.verified} n={v.accepted}"
        cells = [_cell_html(c, v.source) for c in v.cells if c.k > 0]
        target = [_cell_html(c) for c in v.cells if c.k == 0]
        sep = ['<span class="dspark-sep"></span>'] if cells and target else []
        warn = "" if v.consistent else ' <b title="accepted drafts do not match the output">⚠</b>'
        rows.append(_row(v.index, label + warn, cells + sep + target))
        i += 1
    more = ""
    if len(views) > max_rounds + 2:
        more = f"<div>… {len(views) - max_rounds - 2} more rounds not shown</div>"
    head = f"<div><b>{len(spec)} rounds</b> (r = round, ℓ = verify length, n = accepted)</div>"
    return f'{_CSS}<div class="dspark-rounds">{legend_html()}{head}{"".join(rows)}{more}</div>'


def summary_rows(views: Sequence[RoundView], num_tokens: int, seconds: float,
                 baseline_tokens: int | None = None, baseline_seconds: float | None = None) -> dict:
    """The numbers of the summary: τ, tokens/s, mean ℓ, acceptance, times, the baseline and the speedup."""
    spec = [v for v in views if v.index > 0]
    n_rounds = len(spec)
    committed = sum(len(v.committed) for v in spec)
    verified = sum(v.verified for v in spec)
    accepted = sum(v.accepted for v in spec)
    out = {
        "tokens": num_tokens,
        "seconds": seconds,
        "tokens_per_s": num_tokens / seconds if seconds > 0 else None,
        "rounds": n_rounds,
        "tau": committed / n_rounds if n_rounds else None,
        "mean_verify_length": verified / n_rounds if n_rounds else None,
        "acceptance_rate": accepted / verified if verified else None,
        "t_draft_ms": sum(v.t_draft_ms for v in spec) / n_rounds if n_rounds else None,
        "t_verify_ms": sum(v.t_verify_ms for v in spec) / n_rounds if n_rounds else None,
    }
    if baseline_tokens is not None and baseline_seconds:
        out["baseline_tokens_per_s"] = baseline_tokens / baseline_seconds
        if out["tokens_per_s"]:
            out["speedup"] = out["tokens_per_s"] / out["baseline_tokens_per_s"]
    return out


def _fmt(value, spec: str = ".2f", unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


def summary_html(s: dict, note: str = "", note_class: str = "") -> str:
    """The summary table (from :func:`summary_rows`) and an optional note about the comparison."""
    rows = [
        ("τ (tokens per round)", _fmt(s.get("tau"))),
        ("DSpark", f"{s['tokens']} tokens in {s['seconds']:.2f} s = {_fmt(s.get('tokens_per_s'), '.1f')} tok/s"),
        ("plain generate()", f"{_fmt(s.get('baseline_tokens_per_s'), '.1f')} tok/s"),
        ("speedup", _fmt(s.get("speedup"), ".2f", "×")),
        ("rounds", str(s["rounds"])),
        ("mean verify length ℓ", _fmt(s.get("mean_verify_length"))),
        ("draft acceptance (accepted / verified)", _fmt(s.get("acceptance_rate"), ".1%")),
        ("per round: draft / verify", f"{_fmt(s.get('t_draft_ms'), '.1f')} ms / {_fmt(s.get('t_verify_ms'), '.1f')} ms"),
    ]
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    extra = f'<div class="dspark-note {note_class}">{note}</div>' if note else ""
    return f'{_CSS}<div class="dspark-summary"><table>{body}</table>{extra}</div>'


def position_chart_html(counts: dict | None, title: str = "Per-position acceptance this session") -> str:
    """A grouped bar chart (inline SVG) of :func:`position_rows`: per draft slot k, the observed acceptance rate
    (accepted / verified at k) next to the mean predicted survival a_k — the calibration made visible."""
    counts = counts or empty_position_counts()
    rows = position_rows(counts)
    ks = sorted({r["position"] for r in rows})
    colours = {"observed acceptance": "#16a34a", "predicted a_k (mean)": "#2563eb"}
    legend = "".join(
        f'<span style="margin-right:14px"><span style="display:inline-block;width:10px;height:10px;'
        f'background:{c};margin-right:4px"></span>{html.escape(name)}</span>' for name, c in colours.items()
    )
    head = (f'<div class="dspark-chart"><div style="font-weight:600;font-size:14px">{html.escape(title)}</div>'
            f'<div style="font-size:12px;margin:2px 0 4px">{legend} · {counts.get("rounds", 0)} drafted rounds</div>')
    if not ks:
        return head + '<div style="font-size:13px;color:#6b7280">No rounds yet: generate something.</div></div>'
    w_slot, plot_h, left, top = 56, 160, 34, 8
    width, height = max(left + w_slot * len(ks) + 10, 280), top + plot_h + 34
    parts = []
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = top + plot_h * (1 - frac)
        parts.append(f'<line x1="{left}" x2="{width - 6}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e7eb"/>'
                     f'<text x="{left - 4}" y="{y + 3:.1f}" font-size="10" text-anchor="end" fill="#6b7280">'
                     f'{frac:.2g}</text>')
    by_key = {(r["position"], r["series"]): r for r in rows}
    for i, k in enumerate(ks):
        x0 = left + i * w_slot + 6
        for j, (name, colour) in enumerate(colours.items()):
            r = by_key.get((k, name))
            if r is None:
                continue
            bh = plot_h * min(1.0, max(0.0, r["rate"]))
            x, y = x0 + j * 22, top + plot_h - bh
            parts.append(f'<rect x="{x}" y="{y:.1f}" width="20" height="{max(bh, 0.5):.1f}" fill="{colour}">'
                         f'<title>k={k} {html.escape(name)}: {r["rate"]:.3f} over {r["rounds"]} rounds</title></rect>'
                         f'<text x="{x + 10}" y="{y - 2:.1f}" font-size="9" text-anchor="middle" fill="#374151">'
                         f'{r["rate"]:.2f}</text>')
        parts.append(f'<text x="{x0 + 21}" y="{top + plot_h + 14}" font-size="11" text-anchor="middle">k={k}</text>')
    parts.append(f'<text x="{left + (width - left) / 2}" y="{height - 4}" font-size="11" text-anchor="middle" '
                 f'fill="#374151">draft position k (verified slots only)</text>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
           f'aria-label="{html.escape(title)}">{"".join(parts)}</svg>')
    return head + svg + "</div>"
