"""`dspark export`: write a drafter in the format a serving engine or another implementation loads.

    dspark export DRAFTER OUT --format deepspec      # vLLM "method": "dspark", SGLang DSPARK, DeepSpec
    dspark export DRAFTER OUT --format speculators   # vLLM speculators format (also a reduced draft vocabulary)
    dspark export DRAFTER OUT --format dflash        # z-lab DFlash (vLLM "method": "dflash")

DRAFTER is a drafter directory of any format dspark loads (its own, DeepSpec, DFlash, SpecForge, speculators), so
the command also converts between formats. ``--format deepspec`` writes copies of the target's embedding table and
LM head, ``--format speculators`` of a drafter with a reduced draft vocabulary the LM head's rows, and a drafter
with its own copies (a DeepSpec import) written as speculators or DFlash must have copies equal to the target's,
so these load the target (``--target``, default SmolLM2-135M-Instruct;
:func:`modeling_dspark.export.export_needs_target`). What a format cannot hold is refused, with every reason,
before anything is loaded or written (:func:`modeling_dspark.export.check_exportable`); docs/serving.md has the
serving commands. No exported config holds an absolute path of this machine: the speculators format names its
verifier by ``--verifier-name`` (a Hub id or a relative path), else by the drafter's target when that is portable
(the default target is written as ``HuggingFaceTB/SmolLM2-135M-Instruct``); an absolute path is refused.

Exit codes: 0 written, 2 usage or input error (nothing written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import CLIError, drafter_dir, reports_cli_errors, target_for_drafter


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write a drafter as deepspec / speculators / dflash for serving",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drafter", metavar="DRAFTER", help="drafter directory or Hugging Face Hub id (any format dspark "
                   "loads)")
    p.add_argument("out", metavar="OUT", help="output directory (must not exist, or be empty)")
    p.add_argument("--format", required=True, choices=("deepspec", "speculators", "dflash"),
                   help="deepspec: vLLM method dspark / SGLang DSPARK; speculators: vLLM speculators; dflash: DFlash")
    p.add_argument("--target", default=None, metavar="PATH",
                   help="the target's local directory, for --format deepspec, a reduced-vocabulary speculators "
                        "export and a DeepSpec import written as speculators / dflash (default: the drafter's "
                        "target if it is a packaged target or a local directory, else SmolLM2-135M-Instruct)")
    p.add_argument("--verifier-name", default=None, metavar="NAME",
                   help="--format speculators: the verifier's Hub id or relative path written into the export "
                        "(speculators_config.verifier.name_or_path; default: the drafter's target, which must not "
                        "be an absolute path)")


def _load_target(path, dtype):
    """The target model (no tokenizer needed): a local directory, or a packaged target (None: the default)."""
    from modeling_dspark.target import PACKAGED_TARGETS, load_target

    if path is None or path in PACKAGED_TARGETS:
        return load_target(path, dtype=dtype)[0]
    from transformers import AutoModelForCausalLM

    if not Path(path).is_dir():
        raise OSError(f"target {path!r} is not a local model directory")
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _export(args) -> Path:
    from modeling_dspark import DSparkDraftModel, export

    path = drafter_dir(args.drafter)
    try:
        export.check_output_dir(args.out)
        drafter = DSparkDraftModel.from_pretrained(path).eval()
        export.check_exportable(drafter, args.format, need_target=False, verifier_name=args.verifier_name)
    except (OSError, ValueError) as err:
        raise CLIError(str(err)) from None
    if export.export_needs_target(drafter.config, args.format):
        args.target = target_for_drafter(args.target, path, flag="DRAFTER")
        try:
            drafter.bind_target(_load_target(args.target, next(drafter.parameters()).dtype))
        except (OSError, ValueError) as err:
            raise CLIError(f"could not use target {args.target or 'SmolLM2-135M-Instruct'!r}: {err}") from None
    try:
        return export.export_drafter(drafter, args.out, format=args.format, verifier_name=args.verifier_name)
    except (OSError, ValueError) as err:
        raise CLIError(str(err)) from None


@reports_cli_errors("dspark export")
def run(args) -> int:
    out = _export(args)
    print(f"wrote {args.format} drafter to {out}")
    return 0


if __name__ == "__main__":
    from .common import standalone_main

    sys.exit(standalone_main("dspark export", __doc__, add_arguments, run))
