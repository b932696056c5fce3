"""DSpark demo page: speculative decoding you can watch, token by token.

    python app.py                      # http://127.0.0.1:7860, the default target + the shipped drafter
    python app.py --port 7861 --drafter random --dtype float32
    python app.py --host 0.0.0.0       # listen on all interfaces (off by default); --share: a gradio.live link

A thin layer over the library (``modeling_dspark`` loads the models, ``generation`` runs
``target.generate(ids, assistant_model=drafter)`` and records every round, ``dspark.app_render`` turns the
rounds into token rows); the library never imports this file. The functions above :func:`build_ui` do not need a
browser (``tests/test_app.py`` calls them directly).

Concurrency: the model weights are shared and read-only; one lock serialises requests on them (on a CPU two
generations at once are not faster). Everything that belongs to a request — options, verify policy, candidate
generator, statistics, streamer, cancel flag — is created for that request (``dspark_options`` and
``collect_stats`` are context-local, entered in the request's own worker thread), and the acceptance chart lives in
per-session ``gr.State``.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import math
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from dspark.generation import collect_stats, dspark_options  # noqa: E402
from dspark.app_render import (  # noqa: E402
    empty_position_counts,
    first_difference,
    position_chart_html,
    round_views,
    rounds_html,
    summary_html,
    summary_rows,
    update_position_counts,
)

RANDOM_DRAFTER_SEED = 0
RANDOM_DRAFTER_BLOCK_SIZE = 8
DTYPES = ("float32", "bfloat16")
POLICY_CHOICES = ("scheduler", "full", "threshold:0.5", "fixed:1", "fixed:4", "none")
"""The policy dropdown's entries (any spec of :func:`dspark.generation.policies.parse_policy` may be typed in)."""

MAX_PROMPT_CHARS = 4000
MAX_PROMPT_TOKENS = 1024
MAX_NEW_TOKENS = 512
DEFAULT_MAX_NEW_TOKENS = 96
REQUEST_TIMEOUT_S = 600.0  # a generation running longer than this is stopped
QUEUE_TIMEOUT_S = 300.0  # waiting longer than this for the model is an error
MAX_CACHED_DRAFTERS = 4

EXAMPLES = [
    "Explain speculative decoding in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]


class AppError(ValueError):
    """A problem with the request or the models, shown to the user as is."""


# ---------------------------------------------------------------------------------------------- request checks
@dataclass(frozen=True)
class Request:
    """One validated request from the page."""

    prompt: str
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    block_size: int | None = None
    policy: str = "full"
    dtype: str = "float32"
    drafter: str = "random"


def _number(value, name: str, kind=float):
    if value is None or value == "":
        raise AppError(f"{name} is missing")
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise AppError(f"{name} must be a number, got {value!r}") from None
    if kind is float and not math.isfinite(number):
        raise AppError(f"{name} must be finite, got {value!r}")
    if kind is int and float(value) != number:
        raise AppError(f"{name} must be a whole number, got {value!r}")
    return number


def validate_request(prompt, max_new_tokens=DEFAULT_MAX_NEW_TOKENS, decoding="greedy", temperature=1.0, top_p=1.0,
                     seed=0, block_size=None, policy="full", dtype="float32", drafter="random") -> Request:
    """Check the page's inputs before any model work.

    Raises:
        AppError: with a message for the user (empty or too long prompt, out-of-range numbers, unknown options).
    """
    if prompt is None or not str(prompt).strip():
        raise AppError("Empty prompt: type a question or an instruction.")
    prompt = str(prompt)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise AppError(f"Prompt too long: {len(prompt)} characters, the limit is {MAX_PROMPT_CHARS}.")
    max_new_tokens = _number(max_new_tokens, "max new tokens", int)
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise AppError(f"max new tokens must be between 1 and {MAX_NEW_TOKENS}, got {max_new_tokens}.")
    if decoding not in ("greedy", "sampling"):
        raise AppError(f"decoding must be 'greedy' or 'sampling', got {decoding!r}.")
    do_sample = decoding == "sampling"
    temperature, top_p = _number(temperature, "temperature"), _number(top_p, "top-p")
    seed = _number(seed, "seed", int)
    if do_sample:
        if not 0.05 <= temperature <= 5.0:
            raise AppError(f"temperature must be between 0.05 and 5, got {temperature}.")
        if not 0.0 < top_p <= 1.0:
            raise AppError(f"top-p must be in (0, 1], got {top_p}.")
    if not 0 <= seed < 2**63:
        raise AppError(f"seed must be between 0 and 2^63 - 1, got {seed}.")
    if block_size is not None and block_size != "":
        block_size = _number(block_size, "block size", int)
        if block_size < 1:
            raise AppError(f"block size must be at least 1, got {block_size}.")
    else:
        block_size = None
    from dspark.generation.policies import parse_policy

    try:
        policy = parse_policy(str(policy or "full").strip()).name
    except ValueError as err:
        raise AppError(f"verify policy: {err}") from None
    if dtype != "auto" and dtype not in DTYPES:
        raise AppError(f"dtype must be one of auto, {', '.join(DTYPES)}, got {dtype!r}.")
    drafter = (drafter or "").strip() or "random"
    if drafter != "random":  # a directory or a shipped drafter's name; never a download on a visitor's request
        from modeling_dspark.hub import shipped_drafter_dir
        from dspark.pairing import InputError, drafter_dir

        try:
            drafter = drafter_dir(str(shipped_drafter_dir(drafter) or drafter), hub=False)
        except InputError as err:
            raise AppError(f"Drafter: {err}; give a drafter's directory or shipped name, or 'random'.") from None
    if dtype == "auto":
        dtype = auto_dtype(drafter)[0]
    return Request(prompt, max_new_tokens, do_sample, temperature, top_p, seed, block_size, policy, dtype, drafter)


def encode_prompt(tok, prompt: str, limit: int = MAX_PROMPT_TOKENS) -> torch.LongTensor:
    """``[1, P]`` ids of ``prompt`` with the chat template applied.

    Raises:
        AppError: the prompt is empty or longer than ``limit`` tokens after templating.
    """
    from modeling_dspark.target import apply_chat_template

    try:
        ids = apply_chat_template(tok, prompt)
    except ValueError as err:
        raise AppError(str(err)) from None
    if len(ids) > limit:
        raise AppError(f"Prompt too long: {len(ids)} tokens with the chat template, the limit is {limit}.")
    return torch.tensor([ids])


# ---------------------------------------------------------------------------------------------- models
def auto_dtype(drafter: str | None = None, target: str | None = None, device="cpu") -> tuple[str, str]:
    """The faster dtype's name for ``generate()`` with ``drafter`` (a directory; None or ``"random"``: plain
    decoding) on ``target`` here, and why, for the page (:func:`dspark.evaluation.dtype.auto_dtype`: the processor
    decides, or both dtypes are timed once and the result cached)."""
    from dspark.evaluation.dtype import auto_dtype as pick

    dtype, why = pick(target, None if drafter in (None, "random") else drafter, device=device)
    return ("bfloat16" if dtype == torch.bfloat16 else "float32"), why


def default_drafter_spec(target: str | None = None) -> str:
    """The shipped drafter of ``target`` (None: the default target) when it exists, else ``"random"``."""
    from modeling_dspark.target import shipped_drafter_for

    drafter = shipped_drafter_for(target)
    return "random" if drafter is None else str(drafter)


@dataclass
class Models:
    """What one request uses: shared weights (read-only) plus facts the page shows."""

    target: object
    tok: object
    drafter: object
    drafter_label: str
    notice: str = ""


class ModelBank:
    """Loads the target (per dtype) and drafters (per dtype and path) once and hands them to requests.

    ``lock`` guards the shared weights: one generation at a time. Nothing per-request is stored here.
    ``default_dtype`` is the page's preset and ``dtype_reason`` why it was chosen (``"--dtype"``: on the command
    line; None: the page asks :func:`auto_dtype` itself).
    """

    def __init__(self, target_path: str | None = None, default_drafter: str | None = None,
                 default_dtype: str = "float32", dtype_reason: str | None = None):
        self.target_path = target_path
        self.default_dtype = default_dtype
        self.dtype_reason = dtype_reason
        self.default_drafter = default_drafter or default_drafter_spec(target_path)
        self.lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._targets: dict[str, tuple] = {}
        self._drafters: OrderedDict = OrderedDict()

    def target(self, dtype: str):
        with self._load_lock:
            if dtype not in self._targets:
                from modeling_dspark.target import load_target

                try:
                    self._targets[dtype] = load_target(self.target_path, dtype=getattr(torch, dtype))
                except (FileNotFoundError, OSError, ValueError) as err:
                    raise AppError(f"could not load the target: {err}") from None
            return self._targets[dtype]

    def _drafter(self, dtype: str, spec: str, target):
        from modeling_dspark import DSparkConfig, DSparkDraftModel

        key = (dtype, spec)
        with self._load_lock:
            if key in self._drafters:
                self._drafters.move_to_end(key)
                return self._drafters[key]
            if spec == "random":
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(RANDOM_DRAFTER_SEED)
                    config = DSparkConfig.from_target_config(target.config, block_size=RANDOM_DRAFTER_BLOCK_SIZE)
                    drafter = DSparkDraftModel(config)
                drafter = drafter.to(dtype=target.dtype, device=target.device).eval().bind_target(target)
            else:
                try:
                    drafter = DSparkDraftModel.from_pretrained(spec, target=target, dtype=target.dtype).eval()
                except (OSError, ValueError) as err:
                    raise AppError(f"could not load the drafter {spec!r}: {err}") from None
            self._drafters[key] = drafter
            while len(self._drafters) > MAX_CACHED_DRAFTERS:
                self._drafters.popitem(last=False)
            return drafter

    def get(self, dtype: str = "float32", drafter: str | None = None) -> Models:
        """The models for one request (loading them on first use).

        Raises:
            AppError: the target or the drafter cannot be loaded.
        """
        spec = drafter or self.default_drafter
        target, tok = self.target(dtype)
        d = self._drafter(dtype, spec, target)
        notice = ""
        if spec == "random":
            notice = ("Using a random (untrained) drafter: the output is still exactly the target's, but few drafts "
                      "are accepted, so expect a slowdown. Train one with `dspark train` or give a drafter path.")
        label = "random (untrained)" if spec == "random" else spec
        return Models(target, tok, d, label, notice)


# ---------------------------------------------------------------------------------------------- one generation
class _Stop:
    """A stopping criterion: the request was cancelled or ran past its deadline."""

    def __init__(self, cancel: threading.Event, deadline: float):
        self.cancel, self.deadline, self.fired = cancel, deadline, False

    def __call__(self, input_ids, scores, **kwargs):
        stop = self.cancel.is_set() or time.monotonic() > self.deadline
        self.fired |= stop
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


@dataclass
class RunResult:
    """The outcome of one `generate()` call."""

    new_ids: list[int] = field(default_factory=list)
    text: str = ""
    seconds: float = 0.0
    stats: object | None = None
    error: BaseException | None = None
    stopped: bool = False  # cut short by the Stop button or the time limit


def gen_kwargs(req: Request, tok) -> dict:
    """`generate()` keyword arguments for ``req`` (the same for DSpark and plain decoding)."""
    kw = {"max_new_tokens": req.max_new_tokens, "do_sample": req.do_sample}
    if req.do_sample:
        kw.update(temperature=req.temperature, top_p=req.top_p, top_k=None)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad is not None:
        kw["pad_token_id"] = pad
    return kw


def stream_generate(models: Models, ids: torch.LongTensor, req: Request, speculative: bool,
                    cancel: threading.Event | None = None, timeout_s: float = REQUEST_TIMEOUT_S) -> Iterator:
    """Run one `generate()` in a worker thread and yield the text so far as it grows; the last item is the
    :class:`RunResult` (``.error`` set when generation failed; never hangs: the worker is always joined)."""
    from transformers import StoppingCriteriaList, TextIteratorStreamer

    cancel = cancel or threading.Event()
    streamer = TextIteratorStreamer(models.tok, skip_prompt=True, skip_special_tokens=True, timeout=0.2)
    result = RunResult()
    kwargs = gen_kwargs(req, models.tok)
    stop = _Stop(cancel, time.monotonic() + timeout_s)
    stopping = StoppingCriteriaList([stop])

    def work():
        try:
            if req.do_sample:
                torch.manual_seed(req.seed)
            mask = torch.ones_like(ids)
            with torch.inference_mode():
                if speculative:
                    with dspark_options(policy=req.policy, block_size=req.block_size), \
                            collect_stats() as runs:
                        t0 = time.perf_counter()
                        out = models.target.generate(ids, attention_mask=mask, assistant_model=models.drafter,
                                                     streamer=streamer, stopping_criteria=stopping, **kwargs)
                        result.seconds = time.perf_counter() - t0
                    result.stats = runs[-1] if runs else None
                else:
                    t0 = time.perf_counter()
                    out = models.target.generate(ids, attention_mask=mask, streamer=streamer,
                                                 stopping_criteria=stopping, **kwargs)
                    result.seconds = time.perf_counter() - t0
            result.new_ids = out[0, ids.shape[1]:].tolist()
        except BaseException as err:  # shown in the page by the caller
            result.error = err
            streamer.end()

    thread = threading.Thread(target=work, name="dspark-generate", daemon=True)
    thread.start()
    text, finished = "", False
    try:
        while True:
            try:
                piece = next(streamer)
            except StopIteration:
                break
            except Exception:  # queue.Empty: nothing new within 0.2 s
                if not thread.is_alive() and streamer.text_queue.empty():
                    break
                continue
            if piece:
                text += piece
                yield text
        finished = True
    finally:
        if not finished:  # the consumer went away (closed page, Stop button): stop the worker at its next step
            cancel.set()
        thread.join()
    result.stopped = stop.fired
    result.text = models.tok.decode(result.new_ids, skip_special_tokens=True) if result.new_ids else text
    yield result


def near_tie(target, prefix: torch.LongTensor) -> dict:
    """The target's two best next tokens after ``prefix`` ([1, L]) from one forward, and their logit gap."""
    with torch.inference_mode():
        logits = target(prefix, attention_mask=torch.ones_like(prefix)).logits[0, -1].float()
    top = torch.topk(logits, 2)
    v1, v2 = (float(x) for x in top.values)
    return {"ids": [int(i) for i in top.indices], "logits": [v1, v2], "gap": v1 - v2,
            "bf16_spacing": 2.0 ** (math.floor(math.log2(max(abs(v1), 1e-6))) - 7)}


def compare_note(spec_ids: list[int], base_ids: list[int], req: Request, decode, tie: dict | None = None
                 ) -> tuple[str, str]:
    """HTML note on DSpark vs plain `generate()` outputs, and its CSS class (ok / warn / bad).

    Greedy fp32: identical (anything else is a bug and says so). Greedy bf16: where they first differ and why.
    Sampling: same distribution, different draws.
    """
    i = first_difference(spec_ids, base_ids)
    if req.do_sample:
        same = "identical" if i is None else f"different from token {i + 1} on"
        return (f"Sampling: both outputs are draws from the target's distribution (rejection sampling keeps DSpark "
                f"lossless in distribution), not the same draws, so they need not match; here they are {same}.",
                "")
    if i is None:
        return f"Identical outputs, token for token ({len(spec_ids)} tokens, greedy, {req.dtype}).", "dspark-ok"
    tok_a = html.escape(repr(decode(spec_ids[i]))) if i < len(spec_ids) else "(end)"
    tok_b = html.escape(repr(decode(base_ids[i]))) if i < len(base_ids) else "(end)"
    where = f"The outputs agree for the first {i} tokens; at token {i + 1} DSpark has {tok_a}, plain generate() {tok_b}."
    if req.dtype == "float32":
        return where + " In float32 greedy decoding they should be identical: this is a bug, please report it.", \
            "dspark-bad"
    why = (" Why: in bfloat16 the target's verify forward scores ℓ+1 tokens in one batched pass, while plain decoding "
           "runs one-token forwards; the two use different kernels and round differently (bf16 keeps about 3 "
           "significant digits).")
    if tie:
        why += (f" At this position the target's top-2 logits were {html.escape(repr(decode(tie['ids'][0])))} "
                f"{tie['logits'][0]:.3f} and {html.escape(repr(decode(tie['ids'][1])))} {tie['logits'][1]:.3f} "
                f"(gap {tie['gap']:.3f}; the bf16 spacing at this magnitude is {tie['bf16_spacing']:.3f})")
        if tie["gap"] <= 4 * tie["bf16_spacing"]:
            why += ", a near-tie that rounding can flip."
        else:
            why += (", a wider gap than one rounding step: the difference built up over the earlier forwards "
                    "(the K/V caches of the two runs were computed by different kernels).")
    why += " From there on both are valid greedy continuations of the bf16 model; in float32 they are identical."
    return where + why, ""


@dataclass
class Outcome:
    """Everything the page shows after a request."""

    spec: RunResult
    base: RunResult
    views: list
    summary: dict
    rounds_html: str
    summary_html: str
    counts: dict


def run_demo(bank: ModelBank, req: Request, counts: dict | None = None, cancel: threading.Event | None = None,
             compare: bool = True) -> Iterator[tuple[str, object]]:
    """One request, as a stream of ``(what, value)`` events for the page: ``("status", str)``,
    ``("spec_text", str)``, ``("base_text", str)``, ``("notice", str)`` and finally ``("done", Outcome)``.

    Raises:
        AppError: bad request for these models, the models are busy for too long, or generation failed.
    """
    cancel = cancel or threading.Event()
    waited = time.monotonic()
    while not bank.lock.acquire(timeout=0.5):
        if time.monotonic() - waited > QUEUE_TIMEOUT_S:
            raise AppError("The model is busy with other requests; try again in a minute.")
        yield "status", "Waiting for the model (another request is running)…"
    try:
        yield "status", "Loading models…"
        models = bank.get(req.dtype, req.drafter)
        yield "notice", models.notice
        gamma = models.drafter.config.block_size
        if req.block_size is not None and req.block_size > gamma:
            raise AppError(f"block size must be between 1 and {gamma} for this drafter, got {req.block_size}.")
        ids = encode_prompt(models.tok, req.prompt).to(models.target.device)
        block = req.block_size or gamma
        from dspark.generation.policies import parse_policy

        policy = parse_policy(req.policy)
        if policy.needs_confidence and getattr(models.drafter, "confidence_head", None) is None:
            raise AppError(f"The policy {policy.name} is not available: this drafter has no confidence head. "
                           "Choose full or fixed:N.")

        yield "status", "Generating with DSpark…"
        spec = None
        with contextlib.closing(stream_generate(models, ids, req, True, cancel)) as stream:
            for item in stream:
                if isinstance(item, RunResult):
                    spec = item
                else:
                    yield "spec_text", item
        if spec.error is not None:
            raise AppError(f"DSpark generation failed: {type(spec.error).__name__}: {spec.error}")
        yield "spec_text", spec.text

        base = RunResult()
        if compare and not cancel.is_set():
            yield "status", "Generating with plain generate() for comparison…"
            with contextlib.closing(stream_generate(models, ids, req, False, cancel)) as stream:
                for item in stream:
                    if isinstance(item, RunResult):
                        base = item
                    else:
                        yield "base_text", item
            if base.error is not None:
                raise AppError(f"plain generation failed: {type(base.error).__name__}: {base.error}")
            yield "base_text", base.text

        decode = lambda t: models.tok.decode([t])  # noqa: E731
        views = round_views(spec.stats, spec.new_ids, block, req.max_new_tokens, decode) if spec.stats else []
        summary = summary_rows(views, len(spec.new_ids), spec.seconds,
                               len(base.new_ids) if compare else None, base.seconds if compare else None)
        note, note_class = "", ""
        if compare:
            tie = None
            i = first_difference(spec.new_ids, base.new_ids)
            if i is not None and not req.do_sample and req.dtype != "float32":
                tie = near_tie(models.target, torch.cat([ids, torch.tensor([base.new_ids[:i]], dtype=ids.dtype,
                                                                           device=ids.device)], dim=1))
            note, note_class = compare_note(spec.new_ids, base.new_ids, req, decode, tie)
        note = (f"Drafter: {html.escape(models.drafter_label)} · block size γ'={block} · verify policy: {req.policy} · "
                f"{req.dtype} · {'sampling' if req.do_sample else 'greedy'}.<br>" + note)
        counts = update_position_counts(counts, views)
        cut = " (stopped early: time limit or Stop)" if spec.stopped or base.stopped else ""
        yield "status", (f"Done{cut}: {len(spec.new_ids)} tokens, τ={summary['tau'] or 0:.2f}"
                         + (f", speedup {summary['speedup']:.2f}×" if summary.get("speedup") else "") + ".")
        yield "done", Outcome(spec, base, views, summary, rounds_html(views), summary_html(summary, note, note_class),
                              counts)
    finally:
        bank.lock.release()


# ---------------------------------------------------------------------------------------------- the page
PAGE_CSS = """
#dspark-status textarea {font-size: 13px}
.dspark-notice {background:#fef3c7;padding:6px 10px;border-radius:6px}
footer {display:none !important}
"""


def build_ui(bank: ModelBank):
    """The Gradio page. Returns ``(blocks, launch_kwargs)`` (gradio ≥ 6 takes theme/css at launch)."""
    import gradio as gr

    try:
        models = bank.get(bank.default_dtype, bank.default_drafter)
        gamma, notice = models.drafter.config.block_size, models.notice
        sched_ok = getattr(models.drafter, "confidence_head", None) is not None
        drafter_label = models.drafter_label
    except AppError as err:  # the page still comes up and says what is wrong
        gamma, notice, sched_ok, drafter_label = 16, f"Models not loaded: {err}", False, "?"

    theme = gr.themes.Soft(font=["ui-sans-serif", "system-ui", "sans-serif"],
                           font_mono=["ui-monospace", "monospace"])
    style = {"theme": theme, "css": PAGE_CSS}
    major = int(gr.__version__.split(".")[0])
    blocks_kw, launch_kw = ({}, style) if major >= 6 else (style, {})

    with gr.Blocks(title="DSpark speculative decoding", **blocks_kw) as demo:
        gr.Markdown(
            "## DSpark: speculative decoding, token by token\n"
            f"Target **SmolLM2-135M-Instruct** · drafter **{html.escape(drafter_label)}**. Each round the drafter "
            "proposes a block of tokens with a calibrated confidence c_k per token; the target verifies them in one "
            "forward and keeps the accepted prefix plus one token of its own. The output is the target's own."
        )
        notice_box = gr.Markdown(notice, visible=bool(notice), elem_classes=["dspark-notice"], elem_id="dspark-notice")
        counts_state = gr.State(empty_position_counts())
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt (the chat template is applied)", lines=3, elem_id="dspark-prompt",
                                    max_length=MAX_PROMPT_CHARS, placeholder=EXAMPLES[0])
                with gr.Row():
                    run_btn = gr.Button("Generate", variant="primary", elem_id="dspark-run")
                    stop_btn = gr.Button("Stop", elem_id="dspark-stop")
                status = gr.Textbox(label="Status", interactive=False, elem_id="dspark-status", lines=1)
                gr.Examples(EXAMPLES, inputs=[prompt])
            with gr.Column(scale=2):
                with gr.Accordion("Settings", open=True):
                    max_new = gr.Slider(1, MAX_NEW_TOKENS, value=DEFAULT_MAX_NEW_TOKENS, step=1,
                                        label="max new tokens", elem_id="dspark-max-new")
                    decoding = gr.Radio(["greedy", "sampling"], value="greedy", label="decoding")
                    with gr.Row():
                        temperature = gr.Slider(0.05, 2.0, value=0.7, step=0.05, label="temperature")
                        top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="top-p")
                        seed = gr.Number(value=0, precision=0, label="seed", minimum=0)
                    block = gr.Slider(1, gamma, value=gamma, step=1, label=f"block size γ' (1–{gamma})")
                    policy_box = gr.Dropdown(
                        list(POLICY_CHOICES), value="scheduler" if sched_ok else "full", allow_custom_value=True,
                        elem_id="dspark-policy", label="verify policy (none, full, fixed:N, threshold:P, scheduler)",
                        info=("scheduler (the default): ℓ each round from c_k, priced by this machine's measured "
                              "verify and drafting times" if sched_ok
                              else "scheduler: this drafter has no confidence head (it needs c_k)"))
                    if bank.dtype_reason == "--dtype":  # chosen on the command line: nothing to time
                        picked = f"set with --dtype {bank.default_dtype}"
                    else:
                        fast, why = ((bank.default_dtype, bank.dtype_reason) if bank.dtype_reason
                                     else auto_dtype(bank.default_drafter, bank.target_path))
                        picked = f"picked for this machine: {fast} ({why})"
                    dtype = gr.Radio(list(DTYPES), value=bank.default_dtype, label="dtype", elem_id="dspark-dtype",
                                     info=f"{picked}. float32 is token-exact; "
                                          "bfloat16 may part from plain generate() at a near-tie")
                    drafter = gr.Textbox(value=bank.default_drafter,
                                         label="drafter (directory, shipped name or 'random')")
        with gr.Row():
            spec_out = gr.Textbox(label="DSpark output (streams)", lines=6, interactive=False, elem_id="dspark-out")
            base_out = gr.Textbox(label="plain generate() output", lines=6, interactive=False, elem_id="dspark-base")
        with gr.Row():
            with gr.Column(scale=1):
                summary = gr.HTML(elem_id="dspark-summary")
            with gr.Column(scale=1):
                chart = gr.HTML(position_chart_html(None), elem_id="dspark-chart")
                reset_btn = gr.Button("Reset chart", size="sm")
        gr.Markdown("### Rounds: drafted tokens, confidences and verification")
        rounds = gr.HTML(elem_id="dspark-rounds")

        outputs = [status, spec_out, base_out, summary, rounds, chart, counts_state, notice_box]

        def on_generate(prompt_v, max_new_v, decoding_v, temp_v, top_p_v, seed_v, block_v, policy_v, dtype_v,
                        drafter_v, counts_v):
            skip = gr.skip()
            blank = {o: skip for o in outputs}
            cancel = threading.Event()
            try:
                req = validate_request(prompt_v, max_new_v, decoding_v, temp_v, top_p_v, seed_v, block_v, policy_v,
                                       dtype_v, drafter_v)
                yield {**blank, status: "Starting…", spec_out: "", base_out: "", rounds: "", summary: ""}
                for what, value in run_demo(bank, req, counts_v, cancel):
                    if what == "status":
                        yield {**blank, status: value}
                    elif what == "notice":
                        yield {**blank, notice_box: gr.update(value=value, visible=bool(value))}
                    elif what == "spec_text":
                        yield {**blank, spec_out: value}
                    elif what == "base_text":
                        yield {**blank, base_out: value}
                    elif what == "done":
                        yield {**blank, rounds: value.rounds_html, summary: value.summary_html,
                               chart: position_chart_html(value.counts), counts_state: value.counts}
            except AppError as err:
                yield {**blank, status: f"Error: {err}"}
                raise gr.Error(str(err)) from None
            except Exception as err:  # never a hung spinner: say what happened
                yield {**blank, status: f"Error: {type(err).__name__}: {err}"}
                raise gr.Error(f"{type(err).__name__}: {err}") from None
            finally:
                cancel.set()

        inputs = [prompt, max_new, decoding, temperature, top_p, seed, block, policy_box, dtype, drafter, counts_state]
        ev1 = run_btn.click(on_generate, inputs, outputs)
        ev2 = prompt.submit(on_generate, inputs, outputs)
        stop_btn.click(None, None, None, cancels=[ev1, ev2])
        reset_btn.click(lambda: (empty_position_counts(), position_chart_html(None)), None, [counts_state, chart])
    return demo, launch_kw


def warmup(bank: ModelBank) -> None:
    """One short call on each path so the first visitor's timings are not one-time costs."""
    req = Request(prompt="Hi", max_new_tokens=4, drafter=bank.default_drafter, dtype=bank.default_dtype)
    for _ in run_demo(bank, req):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="DSpark demo page (Gradio).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port to listen on (default: 7860)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="the page's starting dtype: auto times both once on this processor and picks the faster "
                        "for the drafter (float32 is token-exact; default: auto)")
    p.add_argument("--share", action="store_true", help="also create a public gradio.live link (off by default)")
    p.add_argument("--target", default=None, metavar="PATH",
                   help="local target checkpoint or packaged target name (default: the drafter's target if it is "
                        "a packaged target or a local directory, else SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None, metavar="PATH|random",
                   help="default drafter (default: the target's shipped drafter if present, else random)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the short warm-up generation at start (default: warm up)")
    args = p.parse_args(argv)
    from dspark.pairing import InputError, target_for_drafter

    try:
        drafter = validate_request("x", drafter=args.drafter or default_drafter_spec(args.target)).drafter
        args.target = target_for_drafter(args.target, drafter)
    except (AppError, InputError) as err:
        print(f"app.py: error: {err}", file=sys.stderr)
        return 2
    dtype, why = (args.dtype, "--dtype") if args.dtype != "auto" else auto_dtype(drafter, args.target)
    print(f"app.py: dtype {dtype} ({why})", file=sys.stderr)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    bank = ModelBank(args.target, drafter, default_dtype=dtype, dtype_reason=why)
    try:
        bank.get(dtype, drafter)
        if not args.no_warmup:
            warmup(bank)
    except AppError as err:
        print(f"app.py: error: {err}", file=sys.stderr)
        return 2
    demo, launch_kw = build_ui(bank)
    demo.queue(default_concurrency_limit=4, max_size=32)
    demo.launch(server_name=args.host, server_port=args.port, share=args.share, show_error=True, **launch_kw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
