"""The `dspark generate` command on the real default target (SmolLM2, CPU, offline), a few tokens per prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark.cli.main import main

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
    n = len(rec["token_ids"])
    assert rec["tokens_per_s"] == pytest.approx(n / rec["seconds"])
    # identical outputs: the speed-up is the ratio of the tokens/s, and the inverse ratio of the seconds
    assert rec["speedup"] == pytest.approx(rec["tokens_per_s"] / rec["baseline_tokens_per_s"])
    assert rec["speedup"] == pytest.approx(rec["baseline_seconds"] / rec["seconds"])
    # τ = committed / rounds; a round commits its accepted drafts and at most one more token, and the rounds commit
    # every token but the prefill's and at most one last plain step
    committed = rec["tau"] * rec["rounds"]
    assert rec["rounds"] >= 1 and committed == pytest.approx(round(committed))
    assert n - 2 <= round(committed) <= min(n - 1, rec["accepted"] + rec["rounds"])
    # the default drafter is the shipped one (no network, no random fallback when it is present)
    from modeling_dspark.target import shipped_drafter_for

    assert rec["drafter"] == str(shipped_drafter_for()) and "random (untrained) drafter" not in cap.err


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
    # --dtype auto says what it picked and why (the tests fix it at float32, conftest)
    assert "dspark generate: dtype float32 (fixed by the tests: float32, not timed)" in cap.err


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
        # options that would be ignored
        (["--prompt", "hi", "--temperature", "0.7", "--top-k", "5"], "--temperature, --top-k apply only with --do-sample"),
        (["--prompt", "hi", "--seed", "0"], "--seed applies only with --do-sample"),
        (["--prompt", "hi", "--top-k", "0"], "--top-k applies only with --do-sample"),
        (["--prompt", "hi", "--do-sample", "--temperature", "nan"], "--temperature must be > 0"),
        (["--prompt", "hi", "--no-draft", "--policy", "full", "--drafter", "random"], "--drafter, --policy need a drafter"),
        (["--prompt", "hi", "--no-draft", "--compare"], "--compare needs a drafter"),
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
    proc = subprocess.run([sys.executable, "-m", "dspark.cli", "generate", "--prompt", ""],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 2
    assert "empty prompt" in proc.stderr and proc.stdout == ""


# ---------------------------------------------------------------------------------------------- consistency
def _subparsers(parser, prefix=()):
    """(command path, parser) for every leaf subcommand of the `dspark` parser."""
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix, parser
        return
    for name, sub in subs[0].choices.items():
        yield from _subparsers(sub, prefix + (name,))


def _commands():
    from dspark.cli.main import build_parser

    return list(_subparsers(build_parser()))


def test_every_option_has_help_and_states_its_default():
    import argparse

    missing = []
    for path, parser in _commands():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            flag = f"dspark {' '.join(path)} {action.option_strings[-1]}"
            text = (action.help or "").strip()
            if not text or text.startswith("("):  # a bare "(default: X)" is no help
                missing.append(f"{flag}: no help text")
            takes_value = action.nargs != 0
            if takes_value and not action.required and "default" not in text and "required" not in text:
                missing.append(f"{flag}: help does not state the default")
    assert not missing, "\n".join(missing)


def test_help_imports_no_model_library():
    """Building the parser (what `dspark --help` and every `dspark COMMAND --help` do) imports neither torch nor
    transformers nor the model package: help answers in a tenth of a second, not the seconds those imports take."""
    code = ("import sys; from dspark.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'modeling_dspark') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


SHARED = {"--dtype", "--device", "--threads"}


def test_shared_flags_are_spelled_the_same_everywhere():
    model_commands = {("generate",), ("data", "build"), ("train",), ("calibrate",), ("eval",), ("profile",),
                      ("bench", "serve"), ("adapt",)}
    commands = dict(_commands())
    assert model_commands <= commands.keys()
    for path in model_commands:
        flags = {s for a in commands[path]._actions for s in a.option_strings}
        assert SHARED <= flags, (path, SHARED - flags)
        dtype = next(a for a in commands[path]._actions if "--dtype" in a.option_strings)
        assert set(dtype.choices) == {"auto", "float32", "bfloat16"}, path
        # no other spelling of the same thing is shown in --help
        shown = {s for a in commands[path]._actions if a.help != "==SUPPRESS==" for s in a.option_strings}
        assert not shown & {"--output-dir", "--bf16", "--cpu"}, path
    for path in (("data", "build"), ("train",), ("calibrate",), ("eval",), ("bench", "serve"), ("adapt",)):
        flags = {s for a in commands[path]._actions for s in a.option_strings}
        assert {"--out-dir", "--no-progress"} <= flags, path


def test_old_spellings_still_parse():
    from dspark.cli.main import build_parser

    p = build_parser()
    a = p.parse_args(["train", "--data", "d", "--output-dir", "o", "--bf16", "--cpu"])
    assert (a.out_dir, a.dtype, a.device) == ("o", "bfloat16", "cpu")
    a = p.parse_args(["data", "build", "--out", "o"])
    assert a.out_dir == "o"


@pytest.mark.parametrize("argv, prog, unknown", [(["generate", "--promt", "hi"], "dspark generate", "--promt hi"),
                                                 (["data", "build", "--bogus"], "dspark data build", "--bogus"),
                                                 (["--bogus"], "dspark", "--bogus")])
def test_an_unknown_option_is_named_by_its_command(argv, prog, unknown, capsys):
    """A typo'd option is reported by the command it was given to, with that command's usage line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{prog}: error: unrecognized arguments: {unknown}" in err
    assert f"usage: {prog}" in err


@pytest.mark.parametrize("argv, missing", [(["eval", "--limit", "1"], "matplotlib"),
                                           (["bench", "serve", "--limit", "1"], "matplotlib"),
                                           (["adapt", "--drafter", "x", "--data", "d"], "peft")])
def test_a_missing_train_extra_is_named_before_the_command_runs(argv, missing, monkeypatch, capsys):
    """A command whose figure or LoRA layers need the [train] extra says so before it runs, not after a whole
    evaluation; `profile --no-plot` and `--show` draw nothing and are not refused, nor is bare `bench`."""
    import importlib.util

    find_spec = importlib.util.find_spec
    ran = []
    for name in ("eval", "bench", "adapt", "profile"):
        monkeypatch.setattr(f"dspark.cli.{name}_cmd.run", lambda args, _n=name: ran.append(_n) or 0)
    def without(gone):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == gone else find_spec(name, *a))

    without(missing)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    usage = "usage: dspark " + " ".join(argv[: 2 if argv[0] == "bench" else 1])
    assert exc.value.code == 2 and not ran and usage in err
    assert f"needs {missing}, which is not installed: pip install 'dspark[train]'" in err
    without("matplotlib")
    assert main(["profile", "--no-plot"]) == 0 and main(["profile", "--show"]) == 0 and main(["bench"]) == 0
    assert ran == ["profile", "profile", "bench"]


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("dspark ") and "torch" in out


def test_bench_serve_does_not_default_to_the_current_directory():
    from dspark.cli.main import build_parser

    a = build_parser().parse_args(["bench", "serve"])
    assert a.out is None and Path(a.out_dir).parts[0] == "runs"


def test_inference_commands_default_to_auto_dtype():
    """Every command that runs the target for inference picks the machine's fast dtype; training stays in float32."""
    from dspark.cli.main import build_parser

    p = build_parser()
    for argv in (["generate", "--prompt", "x"], ["eval"], ["bench", "serve"], ["calibrate", "--drafter", "d"],
                 ["data", "build", "--out-dir", "o"], ["profile"]):
        assert p.parse_args(argv).dtype == "auto", argv
    for argv in (["train", "--data", "d", "--out-dir", "o"], ["adapt", "--drafter", "d", "--data", "d",
                                                             "--out-dir", "o"]):
        assert p.parse_args(argv).dtype == "float32", argv


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"fpu", "avx2", "fma"}, "float32"),  # an AVX2-only CPU (bf16 emulated)
        ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
        ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, "bfloat16"),
        (set(), "float32"),
    ],
)
def test_fast_dtype_reads_the_cpu_flags(flags, expected, tmp_path, monkeypatch):
    import torch

    monkeypatch.undo()  # the real cpu_flags (conftest pins them)

    from modeling_dspark.target import cpu_flags, fast_dtype

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {' '.join(sorted(flags))}\n\n"
                    "processor\t: 1\nflags\t\t: amx_bf16\n")  # only the first processor's flags count
    assert cpu_flags(info) == frozenset(flags)
    assert fast_dtype("cpu", cpu_flags(info)) == getattr(torch, expected)
    assert fast_dtype("cuda", frozenset()) == torch.bfloat16
    assert cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize("major, expected", [(7, "float32"), (8, "bfloat16"), (9, "bfloat16")])
def test_fast_dtype_on_a_gpu_follows_its_compute_capability(major, expected, monkeypatch):
    """bf16 is native on CUDA from compute capability 8.0; --dtype auto picks float32 below it and says why."""
    import types

    import torch

    monkeypatch.undo()  # the real auto_dtype (conftest pins it)

    from dspark.cli.common import resolve_dtype
    from dspark.evaluation.dtype import auto_dtype
    from modeling_dspark.target import fast_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(major=major))
    assert fast_dtype("cuda:0") == getattr(torch, expected)
    dtype, why = auto_dtype(device="cuda")
    assert dtype == getattr(torch, expected) and ("compute capability" in why) == (major < 8), why
    assert resolve_dtype("auto", "cuda", measure=False) == expected


@pytest.mark.real_auto_dtype
def test_auto_dtype_is_announced(monkeypatch, capsys, tmp_path):
    import modeling_dspark.target as target_mod
    from dspark.cli.common import CLIError, resolve_dtype
    from dspark.evaluation import dtype as choice

    monkeypatch.setenv("DSPARK_PROFILE_DIR", str(tmp_path))
    monkeypatch.setattr(choice, "_contention", lambda start, threads: 0.0)
    monkeypatch.setattr(choice, "_time_generate", lambda *a: {"float32": 10.0, "bfloat16": 15.0})
    assert resolve_dtype("auto", "cpu", announce="dspark generate") == "bfloat16"
    err = capsys.readouterr().err
    assert "dtype bfloat16 (measured on this CPU for plain generate(): bfloat16 15.0 tok/s, float32 10.0" in err
    assert "--dtype float32 for token-exact output" in err
    # training decides by the processor alone (a generate() timing says nothing about a training step)
    monkeypatch.setattr(target_mod, "cpu_flags", lambda cpuinfo="/proc/cpuinfo": frozenset({"amx_bf16"}))
    assert resolve_dtype("auto", "cpu", announce="dspark train", measure=False) == "bfloat16"
    assert "bf16 matrix instructions on this CPU" in capsys.readouterr().err
    # an explicit dtype is kept as given, silently
    assert resolve_dtype("bfloat16", "cpu", announce="x") == "bfloat16" and capsys.readouterr().err == ""
    assert resolve_dtype("float32", "cpu", announce="x") == "float32" and capsys.readouterr().err == ""

    def mismatch(*a):  # a drafter built for another target fails the timing's load: a CLI error, no traceback
        raise ValueError("drafter/target mismatch: the drafter was built for a target with hidden size 576")

    monkeypatch.setattr(choice, "_time_generate", mismatch)
    with pytest.raises(CLIError, match="--dtype auto could not time this drafter with this target: drafter/target "
                                       "mismatch"):
        resolve_dtype("auto", "cpu", announce="dspark generate", drafter="drafters/another-target")


def test_bad_policy_is_refused_before_loading(capsys):
    assert main(["generate", "--prompt", "hi", "--policy", "bogus"]) == 2
    assert "--policy" in capsys.readouterr().err


def test_generate_with_the_scheduler_policy(tmp_path, monkeypatch, capsys):
    """--policy scheduler runs with no SPS(B) table anywhere (it learns its prices from the rounds) and writes
    nothing to the profile cache; without --threads, torch runs on the cores :func:`idle_threads` finds."""
    from dspark.cli import generate_cmd

    asked, before = [], torch.get_num_threads()
    monkeypatch.setattr(generate_cmd, "idle_threads", lambda announce: asked.append(announce) or 1)
    monkeypatch.setenv("DSPARK_PROFILE_DIR", str(tmp_path / "profiles"))
    torch.set_num_threads(2)
    try:
        rc = main(["generate", "--prompt", "What is 2 + 2?", "--max-new-tokens", "4", "--json", "--policy",
                   "scheduler", "--dtype", "float32", "--device", "cpu"])
        assert asked == ["dspark generate"] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    (rec,) = _json_lines(cap.out)
    assert 1 <= rec["num_new_tokens"] == len(rec["token_ids"]) <= 4
    assert rec["dtype"] == "float32" and rec["policy"] == "scheduler"
    assert not (tmp_path / "profiles").exists()


def test_idle_threads_leaves_the_cores_other_processes_keep_busy(monkeypatch, capsys):
    """Only this process's CPUs count (4 and 5 are not in its affinity); never more than torch's setting, at least
    one; announced only when lower; torch's setting as it is where OMP_NUM_THREADS sets it or psutil's list does not
    cover the CPU ids."""
    import psutil

    from dspark.cli.common import idle_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    try:
        for current, percent, threads in ((4, [100.0, 95.0, 2.0, 0.0, 100.0, 100.0], 2), (4, [0.0] * 6, 4),
                                          (4, [100.0] * 6, 1), (4, [60.0, 0.0, 0.0, 0.0, 100.0, 100.0], 3),
                                          (2, [100.0, 0.0, 0.0, 0.0, 100.0, 100.0], 2), (4, [0.0, 0.0, 100.0], 4)):
            torch.set_num_threads(current)
            monkeypatch.setattr(psutil, "cpu_percent", lambda interval, percpu, p=percent: p)
            assert idle_threads("dspark generate", interval=0.0) == threads
            err = capsys.readouterr().err
            assert (f"dspark generate: {threads} torch thread(s)" in err) == (threads < current), err
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        monkeypatch.setattr(psutil, "cpu_percent", lambda interval, percpu: [100.0] * 6)
        assert idle_threads("dspark generate", interval=0.0) == 4
    finally:
        torch.set_num_threads(before)


def test_threads_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "hi", "--threads", "0"])
    assert exc.value.code == 2 and "--threads" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["eval"], ["bench", "serve"], ["calibrate"]])
def test_a_drafter_without_valid_config_or_weights_is_refused_before_the_target_loads(command, tmp_path,
                                                                                      no_target_load, capsys):
    (tmp_path / "config.json").write_text('{"block_size": 4,')
    assert main([*command, "--drafter", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "config.json") in err and "not valid JSON" in err, err
    (tmp_path / "config.json").write_text('{"block_size": 4}')
    assert main([*command, "--drafter", str(tmp_path)]) == 2
    assert "has no *.safetensors weights file" in capsys.readouterr().err
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(64)}, str(tmp_path / "model.safetensors"))
    whole = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(whole[:-16])  # a download cut short
    assert main([*command, "--drafter", str(tmp_path)]) == 2
    assert "corrupt weights file model.safetensors" in capsys.readouterr().err


def test_stats_line_says_what_it_measured():
    from dspark.cli.generate_cmd import _stats_line

    rec = {"num_new_tokens": 1, "seconds": 0.5, "tokens_per_s": 2.0, "drafter": "d", "rounds": 0, "tau": 0.0,
           "skipped_draft_rounds": 0, "lookup_rounds": 0, "plain_rounds": 0, "t_draft_ms": 0.0, "t_verify_ms": 0.0,
           "policy": "scheduler (default)"}
    assert "no speculative round" in _stats_line(rec) and "tau" not in _stats_line(rec)
    rec.update(rounds=3, tau=2.0, baseline_tokens_per_s=1.0, speedup=2.0, identical=False, do_sample=True,
               lookup_rounds=1, plain_rounds=1)
    assert "tau=2.00" in _stats_line(rec) and "outputs differ (sampled)" in _stats_line(rec)
    assert "policy scheduler (default): 3 rounds (1 drafted, 1 lookup, 1 plain step)" in _stats_line(rec)
    greedy = dict(rec, do_sample=False, first_difference=19)  # 0-based in --json (it indexes token_ids)
    assert "DIFFER from new token 20 (bfloat16 parts at near-ties" in _stats_line(dict(greedy, dtype="bfloat16"))
    assert _stats_line(dict(greedy, dtype="float32")).endswith("outputs DIFFER from new token 20")


def test_every_environment_variable_is_documented():
    """Each DSPARK_* variable the code or tests read has a row in docs/usage.md's table."""
    import re

    names = set()
    for path in REPO.glob("**/*.py"):
        if ".venv" in path.parts:
            continue
        names |= set(re.findall(r"\bDSPARK_[A-Z_]+\b", path.read_text(errors="replace")))
    usage = (REPO / "docs" / "usage.md").read_text()
    table = usage.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    assert {"DSPARK_CACHE", "DSPARK_PROFILE_DIR"} <= names
    assert not [n for n in names if f"`{n}`" not in table]


def test_an_empty_cache_variable_counts_as_unset(monkeypatch):
    from modeling_dspark.target import cache_dir

    monkeypatch.setenv("DSPARK_CACHE", "")
    assert cache_dir() == Path.home() / ".cache" / "dspark"


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["eval"], ["bench", "serve"],
                                     ["calibrate", "--drafter",
                                      str(REPO / "modeling_dspark" / "drafters" / "smollm2-135m-dspark")],
                                     ["profile"]])
def test_a_target_directory_without_a_model_config_is_refused_first(command, tmp_path, no_target_load, capsys):
    """A directory that is not a model (no config.json) is named as such, not as a tokenizer or drafter problem."""
    (tmp_path / "notes.txt").write_text("not a model")
    assert main([*command, "--target", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--target {str(tmp_path)!r} is not a model directory: it has no config.json" in err, err


def test_load_target_names_a_directory_without_a_model_config(tmp_path):
    from modeling_dspark.target import load_target

    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_target(tmp_path)
