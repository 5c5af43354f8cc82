"""Every accelerate internal that odc_accelerate reads or patches, in one place, checked against the installed version.

Four things need accelerate's internals:

* **FSDP2 on CPU.** accelerate only turns FSDP on for GPU-like distributed types: a multi-process CPU job launched
  with ``distributed_type: FSDP`` comes up as ``DistributedType.NO`` (each process trains alone) or, with
  ``ACCELERATE_USE_CPU``, as ``MULTI_CPU`` with the FSDP plugin dropped. :func:`enable_fsdp2_on_cpu` fixes both, and
  only them: when a process was started by a multi-process launcher (``LOCAL_RANK`` set, ``WORLD_SIZE > 1``), no
  accelerator device is present and FSDP was requested, the process group is created with gloo and the state becomes
  ``DistributedType.FSDP`` with the requested plugin on the CPU device. A GPU run never reaches either branch.
* **Engine creation.** The ODC engine must attach right after accelerate ``fully_shard``-s the model, i.e. after
  ``accelerate.utils.fsdp_utils.fsdp2_prepare_model``, which ``Accelerator._prepare_fsdp2`` calls through the name it
  imported into ``accelerate.accelerator``. :func:`on_fsdp2_prepared` wraps that name.
* **Teardown.** :func:`on_end_training` runs our hooks before and after ``Accelerator.end_training`` (closing the
  engine while the process group exists; releasing what still holds the group once it is destroyed).
* **PEFT models.** :func:`find_final_norm_through_peft` makes the FSDP2 wrapping group a PEFT model's LM head with
  its final norm, as accelerate does for plain models (otherwise TRL's fused LM head all-gathers it per microbatch).

Tested against accelerate 1.15.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

TESTED_ACCELERATE = ((1, 15),)


class AccelerateCompatError(RuntimeError):
    """The installed accelerate lacks an internal that odc_accelerate relies on."""


def _version() -> tuple[int, int]:
    import accelerate

    major, minor = accelerate.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _missing(what: str) -> str:
    import accelerate

    tested = ", ".join(f"{a}.{b}" for a, b in TESTED_ACCELERATE)
    return (
        f"odc_accelerate needs the accelerate internal `{what}`, which accelerate {accelerate.__version__} does not "
        f"have (tested with accelerate {tested}). Install a supported accelerate (pip install 'odc_accelerate[hf]') "
        "or upgrade odc_accelerate."
    )


def _require(obj: Any, attr: str, where: str) -> Any:
    if not hasattr(obj, attr):
        raise AccelerateCompatError(_missing(f"{where}.{attr}"))
    return getattr(obj, attr)


def version_warning() -> str | None:
    if _version() not in TESTED_ACCELERATE:
        import accelerate

        return (
            f"odc_accelerate was tested with accelerate {TESTED_ACCELERATE}, found {accelerate.__version__}; the "
            "patched internals are checked at start-up but behaviour may differ."
        )
    return None


def env_true(name: str) -> bool:
    """Whether an environment variable holds a true value (accelerate's convention: true/1/yes/on)."""
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes", "on")


def _launched_multiprocess() -> bool:
    return int(os.environ.get("LOCAL_RANK", -1)) != -1 and int(os.environ.get("WORLD_SIZE", 1)) > 1


_PATCHED = False


def enable_fsdp2_on_cpu() -> None:
    """Let accelerate run FSDP2 on CPU (gloo) in multi-process jobs. Idempotent; leaves GPU runs untouched.

    Patches ``PartialState._prepare_backend`` (a launched multi-process job with no accelerator device and
    ``ACCELERATE_USE_FSDP=true`` becomes ``MULTI_CPU``/gloo instead of ``NO``) and ``AcceleratorState.__init__`` (a
    ``MULTI_CPU`` state with an FSDP plugin becomes ``FSDP`` with that plugin). FSDP1 on CPU is refused: only
    FSDP2 (``fsdp_version: 2``) is supported there.
    """
    global _PATCHED
    if _PATCHED:
        return
    from accelerate import state as state_mod
    from accelerate.utils import DistributedType

    partial_state = _require(state_mod, "PartialState", "accelerate.state")
    accel_state = _require(state_mod, "AcceleratorState", "accelerate.state")
    original_backend = _require(partial_state, "_prepare_backend", "accelerate.state.PartialState")
    _require(partial_state, "_shared_state", "accelerate.state.PartialState")
    original_init = accel_state.__init__
    if (warning := version_warning()) is not None:
        logger.warning(warning)

    @functools.wraps(original_backend)
    def _prepare_backend(self, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None):
        chosen_backend, distributed_type = original_backend(self, cpu=cpu, sagemaker_dp=sagemaker_dp, backend=backend)
        if (
            distributed_type == DistributedType.NO
            and _launched_multiprocess()
            and env_true("ACCELERATE_USE_FSDP")
            and backend in (None, "gloo")
        ):
            # A launcher started several processes for FSDP, but there is no GPU: without this every process would
            # silently train its own copy of the model.
            logger.info("FSDP requested on a machine without accelerator devices: using gloo on CPU.")
            return "gloo", DistributedType.MULTI_CPU
        return chosen_backend, distributed_type

    @functools.wraps(original_init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if getattr(self, "distributed_type", None) != DistributedType.MULTI_CPU:
            return
        plugin = kwargs.get("fsdp_plugin")
        if plugin is None and env_true("ACCELERATE_USE_FSDP"):
            from accelerate.utils import FullyShardedDataParallelPlugin

            plugin = FullyShardedDataParallelPlugin()
        if plugin is None:
            return
        if getattr(plugin, "fsdp_version", 1) != 2:
            raise ValueError(
                "FSDP on CPU is only supported with FSDP2 by odc_accelerate: set `fsdp_version: 2` in the accelerate "
                "config's fsdp_config (or FullyShardedDataParallelPlugin(fsdp_version=2))."
            )
        mixed_precision = getattr(self, "_mixed_precision", "no")
        if mixed_precision != "no":
            if plugin.mixed_precision_policy is None and mixed_precision == "bf16":
                # On CPU, reduce gradients in fp32 (accelerate's default reduces in bf16): gloo's bf16 sums round at
                # every add, and ODC accumulates a whole step's microbatches in reduce_dtype before the fold. Plain
                # FSDP2 and ODC get the same policy, so their results stay comparable bit for bit.
                import torch
                from torch.distributed.fsdp import MixedPrecisionPolicy

                plugin.mixed_precision_policy = MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.bfloat16
                )
            plugin.set_mixed_precision(mixed_precision)
        self.fsdp_plugin = plugin
        self.distributed_type = DistributedType.FSDP
        partial_state._shared_state["distributed_type"] = DistributedType.FSDP
        logger.info("FSDP2 on CPU with gloo (mixed precision: %s).", mixed_precision)

    partial_state._prepare_backend = _prepare_backend
    accel_state.__init__ = __init__
    _PATCHED = True


_PREPARE_HOOKS: list[Callable[[Any, Any], None]] = []


def find_final_norm_through_peft() -> None:
    """Let accelerate's FSDP2 wrapping find the final norm of a PEFT-wrapped model. Idempotent.

    ``fsdp2_prepare_model`` puts ``[final_norm, lm_head]`` in one FSDP2 group, so that the norm's forward unshards the
    LM head before TRL's fused LM head reads ``lm_head.weight`` directly. ``_find_final_norm`` only looks at
    ``model.<base_model_prefix>``'s children, which on a ``PeftModel`` is the ``*ForCausalLM`` (no norm there): the
    head then sits alone in a group no forward ever unshards, and every fused-head forward all-gathers it with
    ``DTensor.full_tensor()`` (a collective per microbatch; with ODC's unequal microbatch counts, a hang). This looks
    through ``get_base_model()`` first.
    """
    from accelerate.utils import fsdp_utils

    current = _require(fsdp_utils, "_find_final_norm", "accelerate.utils.fsdp_utils")
    if getattr(current, "_odc_wrapped", False):
        return

    @functools.wraps(current)
    def _find_final_norm(model: Any) -> Any:
        unwrap = getattr(model, "get_base_model", None)
        return current(unwrap() if callable(unwrap) else model)

    _find_final_norm._odc_wrapped = True  # type: ignore[attr-defined]
    fsdp_utils._find_final_norm = _find_final_norm


def on_fsdp2_prepared(hook: Callable[[Any, Any], None]) -> None:
    """Call ``hook(accelerator, model)`` every time accelerate has just FSDP2-wrapped a model. Idempotent per hook."""
    import accelerate.accelerator as accelerator_mod

    current = _require(accelerator_mod, "fsdp2_prepare_model", "accelerate.accelerator")
    if not getattr(current, "_odc_wrapped", False):

        @functools.wraps(current)
        def fsdp2_prepare_model(accelerator: Any, model: Any) -> Any:
            model = current(accelerator, model)
            for h in list(_PREPARE_HOOKS):
                h(accelerator, model)
            return model

        fsdp2_prepare_model._odc_wrapped = True  # type: ignore[attr-defined]
        accelerator_mod.fsdp2_prepare_model = fsdp2_prepare_model
    if hook not in _PREPARE_HOOKS:
        _PREPARE_HOOKS.append(hook)


def on_end_training(hook: Callable[[Any], None], *, after: bool = False) -> None:
    """Call ``hook(accelerator)`` in ``Accelerator.end_training``: at its start (before the process group goes) or,
    with ``after=True``, once it has returned (the process group is destroyed)."""
    from accelerate import Accelerator

    current = _require(Accelerator, "end_training", "accelerate.Accelerator")
    if not getattr(current, "_odc_wrapped", False):
        before_hooks: list[Callable[[Any], None]] = []
        after_hooks: list[Callable[[Any], None]] = []
        original = current  # the wrapper must not close over `current`: it is rebound to the wrapper below

        @functools.wraps(original)
        def end_training(self: Any) -> None:
            for h in list(before_hooks):
                h(self)
            original(self)
            for h in list(after_hooks):
                h(self)

        end_training._odc_wrapped = True  # type: ignore[attr-defined]
        end_training._odc_hooks = (before_hooks, after_hooks)  # type: ignore[attr-defined]
        Accelerator.end_training = end_training
        current = end_training
    hooks = current._odc_hooks[1 if after else 0]
    if hook not in hooks:
        hooks.append(hook)


_PLUGIN_FACTORIES: list[Callable[[], Any]] = []


def default_fsdp_plugin(factory: Callable[[], Any]) -> None:
    """When ``Accelerator()`` gets no ``fsdp_plugin`` and the launch asked for FSDP, use ``factory()`` if not None.

    This is how environment-only configuration (``odc-accelerate launch`` exports ``ODC_*`` variables from the
    accelerate config file) reaches code that builds a plain ``Accelerator()``.
    """
    from accelerate import Accelerator

    current = Accelerator.__init__
    if not getattr(current, "_odc_wrapped", False):

        @functools.wraps(current)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("fsdp_plugin") is None and not args and env_true("ACCELERATE_USE_FSDP"):
                for make in _PLUGIN_FACTORIES:
                    plugin = make()
                    if plugin is not None:
                        kwargs["fsdp_plugin"] = plugin
                        break
            current(self, *args, **kwargs)

        __init__._odc_wrapped = True  # type: ignore[attr-defined]
        Accelerator.__init__ = __init__
    if factory not in _PLUGIN_FACTORIES:
        _PLUGIN_FACTORIES.append(factory)
