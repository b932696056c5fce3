"""Constants and the usage-error type shared by the `dspark` subcommands."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DRAFTER = REPO_ROOT / "drafters" / "smollm2-135m-dspark"
RANDOM_DRAFTER_SEED = 0
RANDOM_DRAFTER_BLOCK_SIZE = 8
DTYPES = ("float32", "bfloat16")


def standalone_main(prog: str, doc: str | None, add_arguments, run, argv=None) -> int:
    """``python -m dspark_cli.X_cmd ...``: one sub-command's parser (``add_arguments``) run by ``run`` on ``argv``."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


class CLIError(Exception):
    """A usage or input error: printed on stderr, exit code 2."""


def load_drafter(spec: str, target, dtype):
    """The drafter named by ``spec`` — ``"random"`` (untrained, fixed seed, block size 8) or a drafter directory —
    bound to ``target`` with ``target.generate(..., assistant_model=drafter)`` enabled.

    Raises:
        CLIError: the directory does not hold a loadable drafter for this target.
    """
    import torch

    from modeling_dspark import DSparkConfig, DSparkDraftModel

    if spec == "random":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_DRAFTER_SEED)
            drafter = DSparkDraftModel(
                DSparkConfig.from_target_config(target.config, block_size=RANDOM_DRAFTER_BLOCK_SIZE)
            )
        drafter = drafter.to(dtype=dtype, device=target.device).eval().bind_target(target)
        return drafter
    try:
        return DSparkDraftModel.from_pretrained(spec, target=target, dtype=dtype).eval()
    except (OSError, ValueError) as err:
        raise CLIError(f"could not load drafter: {err}") from None


def read_prompts_jsonl(path) -> list[dict]:
    """Prompts from a JSON-lines file: one object per line with a non-empty ``prompt`` string (``id`` optional).

    Returns ``[{"id", "prompt", "source": "file"}]`` (blank lines skipped).

    Raises:
        CLIError: invalid JSON, a line without a non-empty ``prompt`` string (naming the line), or no prompts.
    """
    import json
    from pathlib import Path

    path = Path(path)
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise CLIError(f"{path}: line {lineno}: invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise CLIError(f"{path}: line {lineno}: expected a JSON object with a 'prompt' field")
            prompt = obj["prompt"]
            if not isinstance(prompt, str) or not prompt.strip():
                raise CLIError(f"{path}: line {lineno}: empty prompt ('prompt' must be a non-empty string)")
            out.append({"id": str(obj.get("id", f"file-{lineno}")), "prompt": prompt, "source": "file"})
    if not out:
        raise CLIError(f"{path}: no prompts (expected JSON lines with a 'prompt' field)")
    return out
