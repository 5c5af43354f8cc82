"""The accelerate configs shipped with the package, and ``--accelerate_config NAME|PATH`` (as in TRL's CLI).

``odc_cpu``: FSDP2 + ODC on CPU, 2 processes. ``odc_gpu``: FSDP2 + ODC on the GPUs of one node, bf16. Both are
YAML files in ``odc_accelerate/cli/accelerate_configs/``, installed with the package.
"""

from __future__ import annotations

import importlib.resources
import os
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PRESETS", "AcceleratePick", "cuda_device_count", "preset_path", "resolve_accelerate_config"]

PRESETS: tuple[str, ...] = ("odc_cpu", "odc_gpu")


def preset_path(name: str) -> str:
    """The path of the shipped preset ``name`` (one of `PRESETS`).

    Raises:
        ValueError: ``name`` is not a preset.
    """
    if name not in PRESETS:
        raise ValueError(f"Unknown accelerate preset {name!r}: choose one of {', '.join(PRESETS)}, or give a path.")
    return str(importlib.resources.files("odc_accelerate.cli").joinpath("accelerate_configs", f"{name}.yaml"))


def cuda_device_count() -> int:
    """The number of visible CUDA devices (0 without torch CUDA support)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True, kw_only=True, slots=True)
class AcceleratePick:
    """The ``accelerate launch`` arguments for one run and what was chosen.

    Attributes:
        launch_args (`list[str]`): the arguments, with ``--config_file PATH`` first when a config was chosen here.
        note (`str`, *optional*): a sentence for the user when a preset was picked by default.
    """

    launch_args: list[str]
    note: str | None = None


def _pop_option(args: list[str], name: str) -> tuple[list[str], str | None]:
    for i, arg in enumerate(args):
        if arg == name:
            if i + 1 >= len(args):
                raise ValueError(f"Expected a value after {name}.")
            return args[:i] + args[i + 2 :], args[i + 1]
        if arg.startswith(name + "="):
            return args[:i] + args[i + 1 :], arg.split("=", 1)[1]
    return args, None


def _has_option(args: Sequence[str], name: str) -> bool:
    return any(arg == name or arg.startswith(name + "=") for arg in args)


def resolve_accelerate_config(launch_args: Sequence[str]) -> AcceleratePick:
    """Turn ``--accelerate_config NAME|PATH`` into accelerate's ``--config_file PATH``; pick a preset without either.

    ``NAME`` is one of `PRESETS`; an existing file is taken as a path. With neither ``--accelerate_config`` nor
    ``--config_file``, the ``odc_gpu`` preset is picked when CUDA is available, else ``odc_cpu``. With ``odc_gpu``
    and no ``--num_processes``, the run gets one process per visible GPU.

    Raises:
        ValueError: ``NAME`` is neither a file nor a preset, or both ``--accelerate_config`` and ``--config_file``
            are given.
    """
    args, value = _pop_option(list(launch_args), "--accelerate_config")
    note = None
    if value is None:
        if _has_option(args, "--config_file"):
            return AcceleratePick(launch_args=args)
        gpus = cuda_device_count()
        value = "odc_gpu" if gpus else "odc_cpu"
        why = f"{gpus} CUDA device(s) found" if gpus else "no CUDA device found"
        note = (
            f"no --accelerate_config given: using the {value} preset ({why}). Pass --accelerate_config "
            f"{'|'.join(PRESETS)}|PATH to choose."
        )
    elif _has_option(args, "--config_file"):
        raise ValueError("Give either --accelerate_config or --config_file, not both.")
    if os.path.isfile(value):
        path = value
    elif value in PRESETS:
        path = preset_path(value)
        if value == "odc_gpu" and not _has_option(args, "--num_processes"):
            gpus = cuda_device_count()
            if gpus:
                args = ["--num_processes", str(gpus), *args]
    else:
        raise ValueError(
            f"--accelerate_config {value!r} is neither a file nor a preset of odc_accelerate ({', '.join(PRESETS)})."
        )
    return AcceleratePick(launch_args=["--config_file", path, *args], note=note)
