"""The torch side of the compat scaffold: the installed torch's release, what differs between the supported ones,
and the lookups every torch compat module shares.

One module per concern (`fsdp`, `keep`, `layout`, `c10d`, `symm_mem`, `dispatch`), each imported on its own. `PATHS`
says, from the installed version, which internal each supported release has; each lookup raises
:class:`~odc_accelerate._compat.CompatError` naming what is missing. What each module holds: docs/versions.md, "What
`_compat/` pins". The tested versions are ``TESTED["torch"]`` in :mod:`odc_accelerate._compat`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import CompatError, check_signature, import_attr, require, version_tuple

_LIBRARY = "torch"
#: Where FSDP2 keeps its internals.
_FSDP = "torch.distributed.fsdp._fully_shard"


def _import(module: str, attr: str) -> Any:
    return import_attr(module, attr, library=_LIBRARY)


def _require(obj: Any, attr: str, where: str) -> Any:
    return require(obj, attr, library=_LIBRARY, where=where)


def _check_signature(func: Any, params: tuple[str, ...], where: str) -> None:
    check_signature(func, params, library=_LIBRARY, where=where)


# ----------------------------------------------------------------- what differs between the supported releases
@dataclass(frozen=True)
class _Path:
    """One FSDP2 internal that the supported torch releases do not all have: the first release with it, and what the
    older ones do instead."""

    internal: str
    since: tuple[int, int]
    before: str


#: The FSDP2 internals whose presence differs between the supported releases (torch 2.11 to 2.15).
PATHS: dict[str, _Path] = {
    "param_groups": _Path(
        "FSDPState._fsdp_param_groups",
        (2, 12),
        "one `FSDPState._fsdp_param_group` per state (None without parameters)",
    ),
    "reduce_scatter_unused_params": _Path(
        "FSDPModule.set_reduce_scatter_unused_params",
        (2, 13),
        "a param group's reduce-scatter holds only the params that got a gradient; the engine reads which from "
        "`foreach_reduce`'s `fsdp_params` and places each one's rows at its own offset",
    ),
    "reduce_scatter_process_group": _Path(
        "FSDPMeshInfo.reduce_scatter_process_group",
        (2, 13),
        "the mesh info holds `shard_process_group` only",
    ),
    "grad_dtypes": _Path(
        "FSDPParam.sharded_grad_dtype",
        (2, 15),
        "every reduced gradient of a param group is cast to the group's `FSDPParamGroup._orig_dtype`, and the "
        "reduce dtype is the group's `_reduce_dtype`, else the params' compute dtype",
    ),
    "reduce_scatter_order": _Path(
        "FSDPParamGroup._reduce_scatter_param_indices",
        (2, 15),
        "a reduce-scatter holds the group's params in their `fsdp_params` order",
    ),
    "grad_accumulates_in_leaf": _Path(
        "FSDPParam.unsharded_accumulated_grad as the unsharded param's own .grad (read-only)",
        (2, 15),
        "a gradient kept without reduce-scatter moves to `FSDPParam.unsharded_accumulated_grad` in the reduce dtype, "
        "and FSDP2 gives a param without a gradient zeros in the compute dtype when it reduces",
    ),
}

#: ``(major, minor)`` of the installed torch; every `PATHS` choice is made from it.
TORCH_VERSION: tuple[int, int] = version_tuple(torch.__version__)


def has(feature: str) -> bool:
    """Whether the installed torch has the `PATHS` internal ``feature`` (decided by its version)."""
    return TORCH_VERSION >= PATHS[feature].since


#: The oldest torch the engine runs on: older releases lack FSDP2 pieces it cannot do without (the comm hooks of
#: ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` and ``set_force_sum_reduction_for_comms`` as 2.11 has
#: them) or were never tested.
MIN_TORCH: tuple[int, int] = (2, 11)

# Public FSDPModule methods the engine calls: present from MIN_TORCH on, checked at engine start all the same.
_MODULE_METHODS = ("set_force_sum_reduction_for_comms", "set_custom_all_gather", "set_custom_reduce_scatter")


def check_torch_release() -> None:
    """Raise :class:`~odc_accelerate._compat.CompatError` if the installed torch is older than `MIN_TORCH`, naming the
    release and what it lacks."""
    if TORCH_VERSION < MIN_TORCH:
        # Imported here, on the refusal path only: the launcher imports `symm_mem`, hence this package, without FSDP2.
        fsdp_module = _import("torch.distributed.fsdp", "FSDPModule")
        missing = [f"FSDPModule.{m}" for m in _MODULE_METHODS if not hasattr(fsdp_module, m)]
        what = f"lacks {', '.join(missing)}" if missing else "was not tested (its FSDP2 internals differ)"
        raise CompatError(
            f"ODCEngine needs torch {MIN_TORCH[0]}.{MIN_TORCH[1]} or newer: torch {torch.__version__} {what}. "
            "Install a supported torch (the range in odc_accelerate's pyproject.toml)."
        )
