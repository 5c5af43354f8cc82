"""``odc-accelerate sft|dpo|grpo|reward|rloo``: the package's training scripts under ``accelerate launch``, as ``trl
sft``.

The arguments are split as TRL's CLI splits them: those the script's dataclasses know (TRL's, plus the ODC options;
``--config recipe.yaml`` included) go to the script, the rest (``--num_processes``, ``--main_process_port``, ...; and
recipe keys no dataclass knows) to ``accelerate launch``. ``--accelerate_config NAME|PATH`` picks the accelerate
config: a preset shipped with the package (``odc_cpu``, ``odc_gpu``) or a file; without it (and without
``--config_file``), ``odc_gpu`` when CUDA is available, else ``odc_cpu``. The run then goes through ``odc-accelerate
launch``, so the config file's ``odc*`` keys reach the workers.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from ..recipe import check_odc_flags
from .presets import PRESETS, resolve_accelerate_config

__all__ = ["COMMANDS", "main", "split_script_args"]

COMMANDS = ("sft", "dpo", "grpo", "reward", "rloo", "kto")

EPILOG = (
    "Launch options (passed to `accelerate launch`): --accelerate_config {presets}|PATH (default: odc_gpu with CUDA, "
    "else odc_cpu), --num_processes N, --main_process_port PORT, and any other `accelerate launch` option. Recipe "
    "keys that no argument above knows go to `accelerate launch` as well."
).format(presets="|".join(PRESETS))


def _subtract_subsequence(items: Sequence[str], subsequence: Sequence[str]) -> list[str]:
    """``items`` without the ordered ``subsequence`` (the arguments the script's parser left over)."""
    rest = iter(subsequence)
    current = next(rest, None)
    out = []
    for item in items:
        if current is not None and item == current:
            current = next(rest, None)
        else:
            out.append(item)
    return out


def split_script_args(name: str, argv: Sequence[str]) -> tuple[list[str], list[str], bool]:
    """Split ``odc-accelerate NAME ARGV`` into the launch arguments and the script's arguments.

    Returns:
        ``(launch_args, script_args, offline_model)``: the arguments for ``accelerate launch`` (``--accelerate_config``
        not yet resolved), those for the script, and whether the script trains the offline default model (no
        ``--model_name_or_path``).

    Raises:
        ValueError: a misspelt ODC key in the recipe or ``--odc*`` flag (with the known ones), or what the script's
            dataclasses refuse.
    """
    module = importlib.import_module(f"odc_accelerate.scripts.{name}")
    argv = list(argv)
    parser = module.make_parser(prog=f"odc-accelerate {name}")
    parser.epilog = EPILOG
    # -h / --help prints the script's arguments and exits here.
    *parsed, config_remaining, cli_remaining = parser.parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    check_odc_flags(cli_remaining)
    model_args = parsed[2]
    return (
        config_remaining + cli_remaining,
        _subtract_subsequence(argv, cli_remaining),
        not model_args.model_name_or_path,
    )


def main(name: str, argv: Sequence[str]) -> int:
    """``odc-accelerate NAME ARGV`` for ``NAME`` in `COMMANDS`; returns the exit status of the launch."""
    from ..scripts._common import DEMO_EXTRA_MESSAGE, offline_tokenizer_available
    from .launch import launch

    try:
        launch_args, script_args, offline_model = split_script_args(name, argv)
        if offline_model and not offline_tokenizer_available():
            raise ValueError(DEMO_EXTRA_MESSAGE)
        pick = resolve_accelerate_config(launch_args)
        if pick.note:
            print(f"odc-accelerate {name}: {pick.note}", file=sys.stderr)
        # The script already builds the ODC trainer: no bootstrap needed.
        return launch([*pick.launch_args, "--module", f"odc_accelerate.scripts.{name}", *script_args], bootstrap=False)
    except ValueError as err:
        print(f"odc-accelerate {name}: {err}", file=sys.stderr)
        return 2
