"""Constants and the usage-error type shared by the `dspark` subcommands."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DRAFTER = REPO_ROOT / "drafters" / "smollm2-135m-dspark"
RANDOM_DRAFTER_SEED = 0
RANDOM_DRAFTER_BLOCK_SIZE = 8
DTYPES = ("float32", "bfloat16")


class CLIError(Exception):
    """A usage or input error: printed on stderr, exit code 2."""
