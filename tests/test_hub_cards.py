"""The hub cards' Python snippets run as written, offline, and give plain ``generate()``'s output (fp32, greedy)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("card", ["smollm2-135m-dspark", "qwen2.5-coder-0.5b-dspark"])
def test_hub_card_snippet_matches_plain_generate(card, monkeypatch):
    text = (REPO / "hub_cards" / f"{card}.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S)
    assert snippet, f"{card}: no python snippet"
    monkeypatch.chdir(REPO)  # the snippets name the drafter by its path in the repository
    scope: dict = {}
    exec(compile(snippet.group(1), f"hub_cards/{card}.md", "exec"), scope)
    target, drafter, ids, out = (scope[k] for k in ("target", "drafter", "ids", "out"))
    assert target.dtype == drafter.dtype == torch.float32
    assert out.shape[1] > ids.shape[1]
    assert torch.equal(out, target.generate(ids, max_new_tokens=64))
