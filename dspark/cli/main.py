"""The `dspark` command: `dspark <subcommand> ...` (also `python -m dspark.cli`).

Subcommands live in modules of this package, each with ``add_parser(subparsers)`` and ``run(args)`` (returning an
exit code or None).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

SUBCOMMAND_MODULES = [
    "dspark.cli.generate_cmd",
    "dspark.cli.data_cmd",
    "dspark.cli.train_cmd",
    "dspark.cli.calibrate_cmd",
    "dspark.cli.eval_cmd",
    "dspark.cli.profile_cmd",
    "dspark.cli.bench_cmd",
    "dspark.cli.adapt_cmd",
    "dspark.cli.export_cmd",
]


NEEDS = {"dspark eval": "matplotlib", "dspark calibrate": "matplotlib", "dspark profile": "matplotlib",
         "dspark bench serve": "matplotlib", "dspark adapt": "peft"}
"""The package of the ``[train]`` extra each command needs (its figure, its LoRA layers), checked before it runs
(`profile --no-plot` and `--show` draw nothing)."""


def version_string() -> str:
    """``dspark X (torch Y, transformers Z)`` from the installed packages' metadata (nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def v(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"dspark {v('dspark')} (torch {v('torch')}, transformers {v('transformers')})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dspark",
        description="DSpark: confidence-scheduled speculative decoding for Hugging Face transformers.",
        epilog="`dspark COMMAND --help` documents each command.",
    )
    parser.add_argument("--version", action="version", version=version_string())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        mod = importlib.import_module(name)
        before = set(subparsers.choices)
        mod.add_parser(subparsers)
        for cmd in set(subparsers.choices) - before:
            subparsers.choices[cmd].set_defaults(_dspark_run=mod.run)
    _name_parsers(parser)
    return parser


def _name_parsers(parser: argparse.ArgumentParser) -> None:
    """Give every (sub)command parser a default naming itself: the deepest one parsed is the command run, whose
    ``prog`` (e.g. ``dspark data build``) an error about unknown options should carry."""
    parser.set_defaults(_dspark_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _name_parsers(sub)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command = vars(args).pop("_dspark_parser", parser)
    if unknown:  # reported by the command's own parser, with its usage line
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    runner = vars(args).pop("_dspark_run", None)  # so that a command's args (kept in manifests) hold options only
    if runner is None:
        parser.print_help(sys.stderr)
        return 2
    need = NEEDS.get(command.prog)
    drawn = not (getattr(args, "no_plot", False) or getattr(args, "show", False))
    if need and drawn and importlib.util.find_spec(need) is None:
        command.error(f"needs {need}, which is not installed: pip install 'dspark[train]' (or {need})")
    rc = runner(args)
    return int(rc) if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
