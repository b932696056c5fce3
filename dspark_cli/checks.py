"""Input checks shared by `dspark train`, `dspark adapt` and `dspark data build`: each raises a one-line
:class:`~dspark_cli.common.CLIError` (exit code 2) naming the option, before any model is loaded."""

from __future__ import annotations

import math
from pathlib import Path

from .common import CLIError


def check_min(args, minimums: dict[str, float], strict: bool = False) -> None:
    """Refuse an option below its minimum.

    Args:
        args: the parsed arguments.
        minimums: ``{dest: minimum}``; an option left at None (unset, optional) passes.
        strict: require ``value > minimum`` instead of ``value >= minimum``.

    Raises:
        CLIError: ``--dest`` below its minimum, or not a finite number (NaN, inf).
    """
    for dest, low in minimums.items():
        value = getattr(args, dest)
        if value is None:
            continue
        ok = math.isfinite(value) and (value > low if strict else value >= low)
        if not ok:
            raise CLIError(f"--{dest.replace('_', '-')} must be {'>' if strict else '>='} {low}, got {value}")


def parse_ints(flag: str, text: str) -> list[int]:
    """``"0,2,4"`` → ``[0, 2, 4]``.

    Raises:
        CLIError: an item that is not a whole number.
    """
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise CLIError(f"{flag} must be comma-separated whole numbers, got {text!r}") from None


def check_target(spec: str | None) -> None:
    """``--target``: None, the default target's name, or an existing local directory.

    Raises:
        CLIError: anything else (targets are never downloaded).
    """
    from modeling_dspark.target import DEFAULT_TARGET

    if spec is not None and spec != DEFAULT_TARGET and not Path(spec).expanduser().is_dir():
        raise CLIError(f"--target {spec!r} is not a local model directory")


def load_target_checked(spec: str | None, **kwargs):
    """``modeling_dspark.target.load_target(spec, **kwargs)``.

    Raises:
        CLIError: the directory does not hold a loadable transformers model and tokenizer.
    """
    from modeling_dspark.target import DEFAULT_TARGET, load_target

    try:
        return load_target(spec, **kwargs)
    except (OSError, ValueError) as err:
        raise CLIError(f"could not load target {spec or DEFAULT_TARGET!r}: {err}") from None


def load_data_dir(path: str, flag: str = "--data"):
    """The rows of data directory ``path`` (:func:`training.data.load_data`).

    Raises:
        CLIError: no such directory, a `dspark data build` directory without finished shards, or neither a build nor
            a ``datasets`` ``save_to_disk`` directory.
    """
    from training.data import load_data

    if not Path(path).is_dir():
        raise CLIError(f"{flag} {path}: directory not found")
    try:
        return load_data(path)
    except (OSError, ValueError) as err:
        raise CLIError(f"{flag} {path}: {err}") from None


def check_out_dir(out_dir: str, resume: str | None) -> None:
    """Refuse to write a new run into a non-empty ``--out-dir`` (its checkpoints and final model would be
    overwritten) unless ``--resume`` is given, and an explicit ``--resume CHECKPOINT`` that does not exist.

    Raises:
        CLIError: ``out_dir`` is a file, is not empty without ``--resume``, or ``resume`` names a missing directory.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out-dir {out_dir} is a file, not a directory")
    if resume is None and out.is_dir() and any(out.iterdir()):
        raise CLIError(f"--out-dir {out_dir} is not empty: pass --resume to continue the run there, or choose a new "
                       "(or empty) --out-dir")
    if resume not in (None, "latest") and not Path(resume).is_dir():
        raise CLIError(f"--resume {resume}: checkpoint directory not found")


def silence_progress(no_progress: bool) -> None:
    """``--no-progress``: turn off the progress bars of ``datasets``, ``transformers`` and ``huggingface_hub``
    (for this process)."""
    if not no_progress:
        return
    import datasets
    import huggingface_hub.utils
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
