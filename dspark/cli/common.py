"""Constants, the shared options and the usage-error type of the `dspark` subcommands.

Every subcommand spells the same thing the same way: ``--dtype auto|float32|bfloat16``, ``--device``,
``--threads``, ``--out-dir`` and ``--no-progress`` come from the ``add_*_option`` helpers below.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from pathlib import Path

from dspark.pairing import (  # noqa: F401  (the commands take these from here)
    RANDOM_DRAFTER_BLOCK_SIZE,
    RANDOM_DRAFTER_SEED,
    InputError,
    check_made_for_target,
    drafter_dir,
    load_drafter,
    load_models,
    load_target_checked,
    target_for_drafter,
    target_of_data,
)

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout (dspark/cli/common.py)
DTYPES = ("float32", "bfloat16")
DTYPE_CHOICES = ("auto", *DTYPES)


CLIError = InputError
"""A usage or input error: printed on stderr, exit code 2 (:func:`reports_cli_errors`); the library's
:class:`dspark.pairing.InputError`, which its checks and loaders raise."""


def reports_cli_errors(prog: str):
    """Decorator for a subcommand's ``run(args)``: a :class:`CLIError` raised inside is printed on stderr as
    ``PROG: error: MESSAGE`` and the command returns exit code 2; any other exception propagates."""

    def decorate(run):
        @functools.wraps(run)
        def checked(args) -> int:
            try:
                return run(args)
            except CLIError as err:
                print(f"{prog}: error: {err}", file=sys.stderr)
                return 2

        return checked

    return decorate


# ---------------------------------------------------------------------------------------------- shared options
def add_dtype_option(p, default: str = "auto") -> None:
    """``--dtype auto|float32|bfloat16`` (resolve with :func:`resolve_dtype`)."""
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=default,
                   help="model dtype: float32 is token-exact (greedy output identical to plain generate()); "
                        "bfloat16 is faster on a GPU or a CPU with native bf16 matrix instructions (AMX, "
                        "AVX512-BF16); auto picks bfloat16 on a GPU and, on a CPU, times both once for the job and "
                        "picks the faster (cached beside the SPS(B) profile) "
                        f"(default: {default})")


def add_model_options(p, dtype: str = "auto", idle: bool = False) -> None:
    """``--dtype``, ``--device`` and ``--threads`` (``idle``: as :func:`add_threads_option`), in that order."""
    add_dtype_option(p, dtype)
    add_device_option(p)
    add_threads_option(p, idle)


def add_device_option(p) -> None:
    """``--device`` (resolve with :func:`resolve_device`)."""
    p.add_argument("--device", default=None, metavar="cpu|cuda[:N]",
                   help="where the models run (default: cuda if available, else cpu)")


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def add_threads_option(p, idle: bool = False) -> None:
    """``--threads N``, N >= 1 (apply with :func:`set_threads`); ``idle``: the command's default is
    :func:`idle_threads`, not torch's setting."""
    default = "the cores idle when the job starts" if idle else "torch's setting, one per core"
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help=f"torch CPU threads (default: {default})")


_FROM_DRAFTER = "the drafter's target if it is a packaged target or a local directory, else SmolLM2-135M-Instruct"


def add_target_option(p, default: str = _FROM_DRAFTER, kind: str = "transformers") -> None:
    """``--target PATH`` (check with :func:`check_target`); ``default`` says what None stands for."""
    p.add_argument("--target", default=None, metavar="PATH",
                   help=f"local {kind} checkpoint directory or packaged target name, e.g. Qwen2.5-Coder-0.5B-Instruct "
                        f"(default: {default})")


def add_out_dir_option(p, default: str | None, what: str) -> None:
    """``--out-dir DIR``; with ``default`` None it is required (checked by :func:`require_out_dir`, so that an
    old spelling added by :func:`add_hidden_alias` can fill it too)."""
    p.add_argument("--out-dir", default=default, metavar="DIR",
                   help=what + (f" (default: {default})" if default is not None else " (required)"))


def require_out_dir(args, prog: str) -> None:
    """Exit with status 2 and a usage error when a required ``--out-dir`` was not given."""
    if getattr(args, "out_dir", None) is None:
        print(f"{prog}: error: the following arguments are required: --out-dir", file=sys.stderr)
        raise SystemExit(2)


def add_progress_option(p) -> None:
    """``--no-progress``."""
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines (default: shown)")


def add_run_options(g, seed_what: str, save_steps: int, keep: int) -> None:
    """The options of a training run that `dspark train` and `dspark adapt` share, in this order: ``--dtype``
    (float32; old spelling ``--bf16``), ``--seed`` (of ``seed_what``), ``--resume``, ``--save-steps``,
    ``--save-total-limit`` (default ``keep``), ``--logging-steps``, ``--num-workers``."""
    add_dtype_option(g, "float32")
    add_hidden_alias(g, "--bf16", "dtype", const="bfloat16")
    g.add_argument("--seed", type=int, default=0, help=f"{seed_what} seed (default: 0)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="resume from CHECKPOINT, or without a value from the latest checkpoint in --out-dir (needed "
                        "to train into a non-empty --out-dir; default: start fresh in a new or empty --out-dir)")
    g.add_argument("--save-steps", type=int, default=save_steps,
                   help=f"checkpoint every N steps (default: {save_steps})")
    g.add_argument("--save-total-limit", type=int, default=keep, help=f"checkpoints kept (default: {keep})")
    g.add_argument("--logging-steps", type=int, default=10, help="log the losses every N steps (default: 10)")
    g.add_argument("--num-workers", type=int, default=0, help="dataloader workers (default: 0)")


def add_trainer_machine_options(p) -> None:
    """``--device`` (old spelling ``--cpu``), ``--threads`` and ``--no-progress`` of `dspark train` and `adapt`."""
    add_device_option(p)
    add_hidden_alias(p, "--cpu", "device", const="cpu")
    add_threads_option(p)
    add_progress_option(p)


def add_hidden_alias(p, flag: str, dest: str, const=None) -> None:
    """An old spelling kept working but left out of ``--help``: ``const`` given, a switch storing it in ``dest``;
    else an option taking a value."""
    if const is None:
        p.add_argument(flag, dest=dest, help=argparse.SUPPRESS)
    else:
        p.add_argument(flag, dest=dest, action="store_const", const=const, help=argparse.SUPPRESS)


def shipped_drafter_for(target: str | None) -> str | None:
    """The directory of the drafter shipped for ``target`` (``--target``; None: the default target) when that is a
    packaged target (:func:`modeling_dspark.target.shipped_drafter_for`), else None."""
    from modeling_dspark.target import shipped_drafter_for as shipped

    drafter = shipped(target)
    return None if drafter is None else str(drafter)


def drafter_or_shipped(spec: str | None, target: str | None) -> tuple[str, str]:
    """``(spec, path)`` of ``--drafter``: None stands for the shipped drafter of ``target`` (None: the default
    target) if it has one, else ``"random"``; ``path`` is its :func:`drafter_dir` (``"random"`` kept), checked before
    any model loads."""
    spec = spec if spec is not None else shipped_drafter_for(target) or "random"
    return spec, (spec if spec == "random" else drafter_dir(spec))


def resolve_device(spec: str | None) -> str:
    """``--device``: None gives ``"cuda"`` if available else ``"cpu"``.

    Raises:
        CLIError: not a torch device, or a CUDA device on a machine without one.
    """
    import torch

    if spec is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise CLIError(f"--device {spec!r} is not a device (use cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {spec}: no CUDA device on this machine")
    if device.type not in ("cpu", "cuda"):
        raise CLIError(f"--device {spec!r}: only cpu and cuda are supported")
    return spec


def resolve_dtype(spec: str, device: str = "cpu", announce: str | None = None, *, target=None, drafter=None,
                  measure: bool = True) -> str:
    """``--dtype``: ``"auto"`` becomes the faster dtype's name for the job the command runs,
    :func:`dspark.evaluation.dtype.auto_dtype` of ``target`` and ``drafter`` (None: plain decoding), which times both
    dtypes once where the processor leaves the choice open; with ``measure=False`` the processor alone decides
    (:func:`modeling_dspark.target.fast_dtype`: training, where a generate() timing says nothing). With ``announce``
    (the command's name) the choice and its reason are said in one line on stderr.

    Raises:
        CLIError: the timing could not load the drafter for the target (e.g. one built for another target).
    """
    import torch

    from modeling_dspark.target import fast_dtype

    if spec != "auto":  # as given: on some CPUs without native bf16, plain bf16 decoding is the faster
        return spec
    if measure:
        from dspark.evaluation.dtype import auto_dtype

        try:
            dtype, why = auto_dtype(target, drafter, device=device)
        except (OSError, ValueError) as err:  # e.g. a drafter built for another target, found by the timing's load
            raise CLIError(f"--dtype auto could not time this drafter with this target: {err}") from None
    else:
        dtype = fast_dtype(device)
        why = ("" if dtype == torch.bfloat16 else "no native ") + "bf16 matrix instructions on this " + \
            ("GPU" if device.startswith("cuda") else "CPU")
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    if announce:
        exact = "" if name == "float32" else "; --dtype float32 for token-exact output"
        print(f"{announce}: dtype {name} ({why}{exact})", file=sys.stderr)
    return name


def idle_threads(announce: str | None = None, interval: float = 0.2) -> int:
    """Torch threads for a CPU job starting now: torch's setting less the logical CPUs of this process's affinity that
    other work keeps busy (CPU time over ``interval`` seconds, psutil), at least 1; torch's setting where
    ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` set it or psutil cannot map the CPU ids. ``announce`` prints a lower
    choice. A thread sharing its core stalls every parallel region: with one of 2 cores busy, plain SmolLM2
    `generate()` ran 6.4 tok/s with 2 threads, 16.1 with 1 (docs/benchmarks.md)."""
    import psutil
    import torch

    current = torch.get_num_threads()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS") or len(cores) < 2:
        return current
    percent = psutil.cpu_percent(interval=interval, percpu=True)
    if max(cores) >= len(percent):
        return current
    busy = sum(percent[c] for c in cores) / 100.0
    threads = max(1, min(current, len(cores) - int(busy + 0.5)))
    if announce and threads < current:
        print(f"{announce}: {threads} torch thread(s): other work kept {busy:.1f} of this job's {len(cores)} CPUs "
              "busy at the start (--threads N to choose)", file=sys.stderr)
    return threads


def set_threads(n: int | None) -> None:
    """``--threads`` (the parser refuses N < 1): set torch's CPU thread count (None: leave it)."""
    if n is not None:
        import torch

        torch.set_num_threads(n)


def standalone_main(prog: str, doc: str | None, add_arguments, run, argv=None) -> int:
    """``python -m dspark.cli.X_cmd ...``: one sub-command's parser (``add_arguments``) run by ``run`` on ``argv``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, dpi: int) -> None:
    """Lay ``fig`` out, write it to ``path`` (its folder made) and close it."""
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


# ---------------------------------------------------------------------------------------------- input checks
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


def check_policy(spec: str, flag: str | None = "--policy") -> str:
    """The name of verify policy ``spec`` (:func:`dspark.generation.policies.parse_policy`).

    Raises:
        CLIError: not a policy (the message led by ``flag`` unless None).
    """
    from dspark.generation.policies import parse_policy

    try:
        return parse_policy(spec).name
    except ValueError as err:
        raise CLIError(f"{flag}: {err}" if flag else str(err)) from None


def check_target(spec: str | None) -> None:
    """``--target``: None, a packaged target's name (:data:`modeling_dspark.target.PACKAGED_TARGETS`), or a local
    model directory (with a ``config.json``).

    Raises:
        CLIError: anything else (targets are never downloaded), with the reason
            (:func:`modeling_dspark.target.check_target_dir`).
    """
    from modeling_dspark.target import PACKAGED_TARGETS, check_target_dir

    if spec is not None and spec not in PACKAGED_TARGETS:
        try:
            check_target_dir(spec)
        except FileNotFoundError as err:
            names = ", ".join(PACKAGED_TARGETS)
            raise CLIError(f"--{err}; or name a packaged target: {names}") from None


def check_eval_sets(flag: str, names: list[str]) -> list[str]:
    """``names`` (of option ``flag``), refused unless a non-empty list of :data:`dspark.training.prompts.EVAL_SETS`.

    Raises:
        CLIError: no name, or an unknown one.
    """
    from dspark.training.prompts import EVAL_SETS

    bad = [s for s in names if s not in EVAL_SETS]
    if not names or bad:
        raise CLIError(f"{flag}: unknown eval set(s) {bad or names}; choose from {', '.join(EVAL_SETS)}")
    return names


def load_data_dir(path: str, flag: str = "--data"):
    """The rows of data directory ``path`` (:func:`dspark.training.data.load_data`).

    Raises:
        CLIError: no such directory, a `dspark data build` directory without finished shards, or neither a build nor
            a ``datasets`` ``save_to_disk`` directory.
    """
    from dspark.training.data import load_data

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
