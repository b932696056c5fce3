"""Products of few rows by the faster of two BLAS calls (:mod:`dspark.generation.products`): the same product, routed
only inside the block, the faster call kept after the trials, `generate()` with a DSpark assistant inside the block,
and float32 greedy output token for token that of plain `generate()` with every routed product swapped."""

from __future__ import annotations

import contextlib
import inspect
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers.generation.utils import GenerationMixin

import modeling_dspark
from dspark.generation import products
from dspark.generation.products import few_row_products, swapped_linear
from tests.conftest import make_drafter, tiny_target

pytestmark = pytest.mark.core


@pytest.fixture
def fresh(monkeypatch):
    """No call measured or chosen yet."""
    monkeypatch.setattr(products, "_timings", {})
    monkeypatch.setattr(products, "_swapped", {})


@pytest.mark.parametrize("shape", [(3, 40), (1, 5, 40), (2, 2, 40)])
def test_swapped_linear_is_the_same_product(shape):
    torch.manual_seed(0)
    x, layer = torch.randn(*shape), nn.Linear(40, 24)
    y = swapped_linear(x, layer.weight, layer.bias)
    assert y.shape == (*shape[:-1], 24) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_routing_lives_inside_the_block_only(fresh):
    class Quantised(nn.Linear):
        pass

    def own_forward(x):
        return x

    hooked = nn.Linear(8, 8)
    hooked.forward = own_forward  # as accelerate's hooks set it
    model = nn.Sequential(nn.Linear(8, 8), Quantised(8, 8), hooked)
    with pytest.raises(RuntimeError, match="inside"), few_row_products(model, None):
        routed = model[0].forward
        assert "forward" in model[0].__dict__ and "forward" not in model[1].__dict__ and hooked.forward is own_forward
        with few_row_products(model):  # nested: the outer routing stays, and stays after the inner block
            assert model[0].forward is routed
        assert model[0].forward is routed
        raise RuntimeError("raised inside the block")
    assert "forward" not in model[0].__dict__ and hooked.forward is own_forward


def test_a_hook_set_inside_the_block_survives_and_shared_modules_are_routed_once(fresh):
    shared = nn.Linear(8, 8)
    target, drafter = nn.Sequential(shared, nn.Linear(8, 8)), nn.Sequential(shared)

    def hook(x):
        return x

    with few_row_products(target, drafter):
        assert sum("forward" in vars(m) for m in target.modules()) == 2
        target[1].forward = hook  # e.g. accelerate's add_hook_to_module inside the block
    assert "forward" not in vars(shared) and target[1].forward is hook


def test_keyword_input_and_the_fallbacks_to_torchs_call(fresh):
    torch.manual_seed(0)
    layer = nn.Linear(16, 16)
    with few_row_products(layer):
        with torch.no_grad():
            assert layer(input=torch.randn(3, 16)).shape == (3, 16)
            layer(torch.randn(products.MAX_ROWS + 1, 16))  # too many rows
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert layer(torch.randn(3, 16)).dtype == torch.bfloat16  # as F.linear under autocast
        layer(torch.randn(3, 16)).sum().backward()  # with grad
    assert list(products._timings) == [((16, 16), 3, torch.get_num_threads())]  # only the keyword call was timed
    assert sum(map(len, products._timings[((16, 16), 3, torch.get_num_threads())])) == 1


def test_two_same_shaped_layers_run_in_turn_are_each_timed_with_both_calls(fresh, monkeypatch):
    ran = []
    monkeypatch.setattr(products, "swapped_linear", lambda x, w, b=None: ran.append((id(w), "swapped")) or x @ w.T)
    monkeypatch.setattr(products, "F", SimpleNamespace(linear=lambda x, w, b=None: ran.append((id(w), "F")) or x @ w.T))
    first, second, x = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False), torch.randn(2, 8)
    with torch.no_grad(), few_row_products(first, second):
        for _ in range(products.TRIALS):
            second(first(x))
    assert set(ran) == {(id(m.weight), call) for m in (first, second) for call in ("F", "swapped")}


def _slowed(fn):
    def slow(*args):
        time.sleep(0.002)
        return fn(*args)

    return slow


@pytest.mark.parametrize("slow", ["swapped", "F.linear"])
def test_the_faster_call_is_kept_after_the_trials(fresh, monkeypatch, slow):
    if slow == "swapped":
        monkeypatch.setattr(products, "swapped_linear", _slowed(products.swapped_linear))
    else:
        monkeypatch.setattr(products, "F", SimpleNamespace(linear=_slowed(F.linear)))
    torch.manual_seed(0)
    layer, half, x = nn.Linear(16, 16), nn.Linear(16, 16).to(torch.bfloat16), torch.randn(1, 3, 16)
    with torch.no_grad(), few_row_products(layer, half):
        outs = [layer(x) for _ in range(2 * products.TRIALS + 2)]
        layer(x[:, :1])  # one row: F.linear, neither timed nor decided
        half(x.bfloat16())  # bfloat16: F.linear, neither timed nor decided
    assert products._swapped == {((16, 16), 3, torch.get_num_threads()): slow == "F.linear"}
    assert all(len(times) == products.TRIALS for pair in products._timings.values() for times in pair)
    for out in outs:
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_generate_runs_the_loop_inside_the_block_with_a_dspark_assistant_only(monkeypatch):
    seen = []

    @contextlib.contextmanager
    def recorder(*models):
        seen.append(models)
        yield

    monkeypatch.setattr(modeling_dspark, "few_row_products", recorder)
    target = tiny_target(vocab_size=32)
    drafter = make_drafter(target, block_size=4)
    ids = torch.tensor([[1, 2, 3, 4, 1, 2, 3]])
    target.generate(ids, assistant_model=drafter, max_new_tokens=6, do_sample=False)
    assert len(seen) == 1 and seen[0][0] is target and seen[0][1] is drafter
    target.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=6, do_sample=False)
    assert len(seen) == 1
    # generate() reads the loop's parameters through __wrapped__ (inputs_tensor is passed only where declared)
    assert "inputs_tensor" in inspect.signature(GenerationMixin._assisted_decoding).parameters


def test_no_module_stays_routed_after_generate():
    target = tiny_target(vocab_size=32)
    drafter = make_drafter(target, block_size=4)
    target.generate(torch.tensor([[1, 2, 3, 4, 1, 2, 3]]), assistant_model=drafter, max_new_tokens=6, do_sample=False)
    assert not any("forward" in vars(m) for model in (target, drafter) for m in model.modules())


class _AlwaysSwapped(dict):
    def get(self, key, default=None):
        return True


def test_greedy_identical_with_every_product_swapped(smollm, prompt_ids, monkeypatch):
    from modeling_dspark import DSparkDraftModel

    target, _ = smollm
    drafter = DSparkDraftModel.from_pretrained("smollm2-135m-dspark", target=target, dtype=torch.float32).eval()
    references = [target.generate(ids, max_new_tokens=48, do_sample=False) for ids in prompt_ids[:3]]
    monkeypatch.setattr(products, "_swapped", _AlwaysSwapped())
    calls = []
    monkeypatch.setattr(products, "swapped_linear", lambda *a: calls.append(1) or swapped_linear(*a))
    for ids, ref in zip(prompt_ids[:3], references):
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=48, do_sample=False)
        assert torch.equal(out, ref)
    assert calls  # the verifies and drafting rounds ran the swapped call
