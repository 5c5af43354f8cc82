"""``odc-accelerate config``: write an accelerate config file for FSDP2 + ODC, as ``accelerate config`` does.

Each setting comes from its flag (every ODC option by its config key), else a question with a default, else with
``--default`` the default. The file is the ``odc_cpu`` or ``odc_gpu`` preset with the answers applied, checked before
it is written, to accelerate's default config file unless ``--config_file``; an existing file is replaced only with
``--force``. See docs/configuration.md.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from ..config import ODCConfig, option_fields
from ..validation import check_positive_int
from .presets import cuda_device_count, preset_path

__all__ = ["build_config", "config_option_fields", "main", "make_parser", "write_config"]

MIXED_PRECISION = ("no", "bf16", "fp16")
# Options asked for when no flag gives them, with the short flag each also accepts.
_ASKED = {"transport": "--transport", "plan": "--plan"}


def config_option_fields() -> list:
    """The `ODCConfig` option fields that ``odc-accelerate config`` takes as flags: all but ``enable`` (the file it
    writes always turns ODC on)."""
    return [f for f in option_fields() if f.name != "enable"]


def make_parser() -> argparse.ArgumentParser:
    """The parser of ``odc-accelerate config``."""
    parser = argparse.ArgumentParser(
        prog="odc-accelerate config",
        description="Write an accelerate config file for FSDP2 + ODC: asks for each setting not given as a flag "
        "(Enter keeps the default shown), or, with --default, writes the defaults without asking.",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gpu", dest="device", action="store_const", const="gpu", help="GPUs of one node.")
    where.add_argument("--cpu", dest="device", action="store_const", const="cpu", help="CPU processes (gloo).")
    parser.add_argument("--num_processes", help="Processes (default: the GPU count, or 2 on CPU).")
    # One flag per ODC option, generated from ODCConfig (its key, as on every other surface).
    for f in config_option_fields():
        names = [f"--{f.metadata['key']}"] + ([_ASKED[f.name]] if f.name in _ASKED else [])
        asked = " Asked for when not given." if f.name in _ASKED else ""
        parser.add_argument(*names, dest=f.name, help=f.metadata["help"] + asked)
    parser.add_argument(
        "--mixed_precision", choices=MIXED_PRECISION, help="Mixed precision (default: bf16 on GPUs, no on CPU)."
    )
    parser.add_argument(
        "--config_file",
        help="Where to write the file (default: accelerate's default config file, read by `accelerate launch` and "
        "`odc-accelerate launch` without --config_file).",
    )
    parser.add_argument("--default", action="store_true", help="Write the defaults without asking.")
    parser.add_argument(
        "--force", action="store_true", help="Replace the file if it exists (without it, an existing file is kept)."
    )
    return parser


def _choice(choices: Sequence[str], what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        text = text.strip().lower()
        if text not in choices:
            raise ValueError(f"{what} must be one of {', '.join(choices)}, got {text!r}.")
        return text

    return parse


def _ask(question: str, default: Any, parse: Callable[[str], Any], ask: Callable[[str], str]) -> Any:
    """Ask until the answer parses; Enter (or the end of the input) keeps ``default``."""
    while True:
        try:
            answer = ask(f"{question} [{default}]: ")
        except EOFError:
            return default
        if not answer.strip():
            return default
        try:
            return parse(answer)
        except ValueError as err:
            print(err, file=sys.stderr)


def build_config(
    *,
    device: str,
    num_processes: int,
    transport: str = "auto",
    plan: str = "free",
    mixed_precision: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The accelerate config (a mapping) for FSDP2 + ODC: the ``odc_<device>`` preset with these settings.

    Args:
        options:
            Further ODC options by `ODCConfig` field name (``memory_policy="auto"``); `None` leaves one out of the
            file (its default applies).

    Raises:
        ValueError: an invalid setting, naming it.
        TypeError: an option that is not an ODC option.
    """
    import yaml

    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be cpu or gpu, got {device!r}.")
    num_processes = check_positive_int(num_processes, "num_processes")
    given = {name: value for name, value in options.items() if value is not None}
    unknown = set(given) - {f.name for f in config_option_fields()}
    if unknown:
        raise TypeError(f"Unknown ODC option(s): {', '.join(sorted(unknown))}.")
    # One check (and coercion) of the ODC values, by ODCConfig itself.
    resolved = ODCConfig(enable=True, transport=transport, plan=plan, **given)
    with open(preset_path(f"odc_{device}"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    config["num_processes"] = num_processes
    if mixed_precision is not None:
        _choice(MIXED_PRECISION, "mixed_precision")(mixed_precision)
        config["mixed_precision"] = mixed_precision
    keys = {f.name: f.metadata["key"] for f in config_option_fields()}
    # The file holds plain strings (yaml.safe_dump refuses the `PlanName` enum).
    config["fsdp_config"].update(odc=True, odc_transport=resolved.transport, odc_plan=str(resolved.plan))
    config["fsdp_config"].update({keys[name]: _plain(getattr(resolved, name)) for name in given})
    return config


def _plain(value: Any) -> Any:
    # The file holds plain values: yaml.safe_dump refuses str enums (`ReductionName`, `PlanName`) given from Python.
    return value.value if isinstance(value, enum.Enum) else value


def write_config(config: dict[str, Any], path: str, force: bool = False) -> None:
    """Write ``config`` to ``path`` (YAML), after checking it as ``odc-accelerate launch`` and accelerate do.

    Raises:
        FileExistsError: ``path`` exists and ``force`` is not set (the file is left as it was).
    """
    import yaml

    from .._compat.accelerate import load_config_file
    from .launch import odc_env_from_config

    text = (
        "# FSDP2 + ODC, written by `odc-accelerate config`. Launch with `odc-accelerate launch --config_file <this "
        "file>`\n# (plain `accelerate launch` ignores the odc* keys).\n" + yaml.safe_dump(config, sort_keys=True)
    )
    if os.path.exists(path) and not force:
        raise FileExistsError(_exists_message(path))
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".yaml", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        odc_env_from_config(tmp)
        load_config_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _exists_message(path: str) -> str:
    return (
        f"{path} exists and was left as it is (plain `accelerate launch` may be using it). Pass --force to replace it, "
        "or --config_file PATH to write another file and launch with `odc-accelerate launch --config_file PATH`."
    )


def main(argv: Sequence[str], ask: Callable[[str], str] = input) -> int:
    """``odc-accelerate config ARGV``; ``ask`` reads one answer (``input`` by default)."""
    from .._compat import CompatError
    from .._compat.accelerate import check_launch, default_config_file
    from ..planning import PLANS
    from ..transport import TRANSPORTS

    opts = make_parser().parse_args(list(argv))
    try:
        check_launch()  # accelerate's config-file helpers, read below
    except CompatError as err:
        print(f"odc-accelerate config: {err}", file=sys.stderr)
        return 2

    def setting(value: Any, question: str, default: Any, parse: Callable[[str], Any]) -> Any:
        if value is not None:
            return parse(str(value))
        return default if opts.default else _ask(question, default, parse, ask)

    path = opts.config_file or default_config_file()
    # Refuse before asking anything: an existing file (accelerate's default config above all) is the user's.
    if os.path.exists(path) and not opts.force:
        print(f"odc-accelerate config: {_exists_message(path)}", file=sys.stderr)
        return 1
    gpus = cuda_device_count()
    try:
        device = setting(
            opts.device, "Run on gpu or cpu?", "gpu" if gpus else "cpu", _choice(("gpu", "cpu"), "device")
        )
        default_processes = (gpus or 8) if device == "gpu" else 2
        num_processes = setting(
            opts.num_processes,
            "How many processes (one per GPU)?" if device == "gpu" else "How many processes?",
            default_processes,
            lambda text: check_positive_int(text, "num_processes"),
        )
        transport = setting(
            opts.transport, f"ODC transport ({', '.join(TRANSPORTS)})?", "auto", _choice(TRANSPORTS, "transport")
        )
        plan = setting(opts.plan, f"Microbatch plan ({', '.join(PLANS)})?", "free", _choice(PLANS, "plan"))
        mixed_precision = setting(
            opts.mixed_precision,
            f"Mixed precision ({', '.join(MIXED_PRECISION)})?",
            "bf16" if device == "gpu" else "no",
            _choice(MIXED_PRECISION, "mixed_precision"),
        )
        others = {f.name: getattr(opts, f.name) for f in config_option_fields() if f.name not in _ASKED}
        config = build_config(
            device=device,
            num_processes=num_processes,
            transport=transport,
            plan=plan,
            mixed_precision=mixed_precision,
            **others,
        )
        write_config(config, path, force=opts.force)
    except (ValueError, FileExistsError) as err:
        print(f"odc-accelerate config: {err}", file=sys.stderr)
        return 2
    print(f"odc-accelerate config: wrote {path}")
    return 0
