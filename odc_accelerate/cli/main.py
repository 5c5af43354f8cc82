"""``odc-accelerate``: the command-line entry point and its subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main", "make_parser"]

_COMMANDS = {
    "launch": "`accelerate launch` that honours the ODC keys of the accelerate config file; TRL's own scripts train "
    "with ODC under it",
    "config": "write an accelerate config file for FSDP2 + ODC (questions with defaults, or flags)",
    "sft": "supervised fine-tuning with ODC (TRL's `trl sft` arguments plus the ODC options)",
    "dpo": "Direct Preference Optimization with ODC (TRL's `trl dpo` arguments plus the ODC options)",
    "grpo": "Group Relative Policy Optimization with ODC (TRL's `trl grpo` arguments plus the ODC options)",
    "reward": "reward modelling with ODC (TRL's `trl reward` arguments plus the ODC options)",
    "rloo": "REINFORCE Leave-One-Out with ODC (TRL's `trl rloo` arguments plus the ODC options)",
    "kto": "Kahneman-Tversky Optimization with ODC (TRL's `trl kto` arguments plus the ODC options)",
}


def make_parser() -> argparse.ArgumentParser:
    """The top-level parser: it only picks the subcommand, which parses the rest itself."""
    parser = argparse.ArgumentParser(
        prog="odc-accelerate",
        description="On-Demand Communication (ODC) for FSDP2 and Hugging Face training. Each command has --help.",
        allow_abbrev=False,
    )
    subparsers = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for name, text in _COMMANDS.items():
        subparsers.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``odc-accelerate ARGV``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = make_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command not in _COMMANDS:
        parser.print_usage(sys.stderr)
        print(f"odc-accelerate: unknown command {command!r}; choose one of {', '.join(_COMMANDS)}.", file=sys.stderr)
        return 2
    if command == "launch":
        from .launch import main as launch_main

        return launch_main(rest)
    from .launch import ACCELERATE_MISSING, accelerate_missing

    if accelerate_missing():
        print(f"odc-accelerate: {ACCELERATE_MISSING}", file=sys.stderr)
        return 2
    if command == "config":
        from .config import main as config_main

        return config_main(rest)
    from .training import main as training_main

    return training_main(command, rest)


if __name__ == "__main__":
    sys.exit(main())
