"""The `dspark generate` command on the real default target (SmolLM2, CPU, offline), a few tokens per prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_cli.main import main

REPO = Path(__file__).resolve().parent.parent
REQUIRED = {"token_ids", "text", "rounds", "tau", "tokens_per_s"}


def _json_lines(out: str) -> list[dict]:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return [json.loads(ln) for ln in lines]


def test_json_compare_fp32_identical(capsys):
    rc = main(["generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "4",
               "--json", "--compare", "--dtype", "float32"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    (rec,) = _json_lines(cap.out)
    assert REQUIRED | {"baseline_tokens_per_s", "speedup", "identical"} <= rec.keys()
    assert rec["identical"] is True
    assert 1 <= len(rec["token_ids"]) <= 4 and all(isinstance(t, int) for t in rec["token_ids"])
    assert rec["tokens_per_s"] > 0 and rec["baseline_tokens_per_s"] > 0 and rec["speedup"] > 0
    assert rec["rounds"] >= 1 and rec["tau"] >= 1.0
    # the default drafter is the shipped one (no network, no random fallback when it is present)
    from dspark_cli.generate_cmd import SHIPPED_DRAFTER

    assert rec["drafter"] == str(SHIPPED_DRAFTER) and "random (untrained) drafter" not in cap.err


def test_prompts_file_two_lines(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Say hi."}) + "\n\n" + json.dumps({"prompt": "Name a color.", "id": 7}) + "\n")
    rc = main(["generate", "--prompts-file", str(f), "--max-new-tokens", "4", "--json", "--block-size", "2"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    recs = _json_lines(cap.out)
    assert [r["prompt"] for r in recs] == ["Say hi.", "Name a color."]
    for r in recs:
        assert REQUIRED <= r.keys()
        assert len(r["token_ids"]) <= 4


def test_no_draft_and_text_output(capsys):
    rc = main(["generate", "--prompt", "Hello", "--no-draft", "--max-new-tokens", "4"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    lines = cap.out.strip().splitlines()
    assert lines[-1].startswith("[dspark]") and "tok/s" in lines[-1]
    assert "random" not in cap.err


def test_sampling_seeded_reproducible(capsys):
    argv = ["generate", "--prompt", "Tell me a word.", "--max-new-tokens", "4", "--json", "--do-sample",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]
    assert main(argv) == 0
    first = _json_lines(capsys.readouterr().out)[0]["token_ids"]
    assert main(argv) == 0
    assert _json_lines(capsys.readouterr().out)[0]["token_ids"] == first


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt", "   "], "empty prompt"),
        (["--prompts-file", "/nonexistent/prompts.jsonl"], "prompts file not found"),
        (["--prompt", "hi", "--drafter", "/nonexistent/drafter"], "drafter directory not found"),
        (["--prompt", "hi", "--block-size", "0"], "--block-size"),
        ([], "no prompt"),
    ],
)
def test_errors_before_loading(extra, message, capsys):
    assert main(["generate", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "error" in err


def test_bad_json_line_names_line(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    assert main(["generate", "--prompts-file", str(f)]) == 2
    assert "line 2" in capsys.readouterr().err
    f.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    assert main(["generate", "--prompts-file", str(f)]) == 2
    assert "line 2" in capsys.readouterr().err


def test_block_size_above_drafter(capsys):
    assert main(["generate", "--prompt", "hi", "--block-size", "9", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "--block-size must be in [1, 8]" in err


def test_python_m_entry_point_error_exit_code():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "dspark_cli", "generate", "--prompt", ""],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 2
    assert "empty prompt" in proc.stderr and proc.stdout == ""
