"""ODC for `accelerate`: the `ODCPlugin` (an FSDP2 plugin that attaches an `ODCEngine`), and `enable()`.

An unmodified accelerate loop trains with ODC as it is: accelerate's own optimizer step drives the engine
(`drive_steps`). A loop may also call the engine itself (`get_engine`): ``engine.pre_optimizer_step(optimizer)`` before
clipping and ``optimizer.step()``, ``engine.post_optimizer_step()`` after; the full loop is in docs/integrations.md
("accelerate: `ODCPlugin`") and docs/design.md ("Using the engine directly").
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import weakref
from collections.abc import Iterator
from dataclasses import InitVar, dataclass, field, fields
from typing import Any, ClassVar

from accelerate.utils import FullyShardedDataParallelPlugin

from .._compat import accelerate as compat
from ..config import ODCConfig, option_fields
from ..validation import str_to_bool

logger = logging.getLogger(__name__)

__all__ = [
    "ODCPlugin",
    "drive_steps",
    "enable",
    "get_engine",
    "get_frozen_engines",
    "odc_plugin_from_env",
    "prepare_frozen_model",
    "release_frozen_model",
    "resolved_options",
]


def enable() -> None:
    """Install what ODC needs inside accelerate. Idempotent; importing odc_accelerate patches nothing.

    * FSDP2 on CPU: a multi-process launch with ``distributed_type: FSDP`` and no GPU runs FSDP2 over gloo
      (accelerate alone would train one model copy per process); GPU runs are untouched.
    * The ODC engine attaches right after accelerate ``fully_shard``-s a model prepared under an `ODCPlugin`.
    * ``Accelerator.end_training`` closes the engines and, once the process group is destroyed, releases what still
      references it (so that gloo's worker threads end before the interpreter does).
    * ``Accelerator()`` without an ``fsdp_plugin`` under ``ODC_ENABLE=true`` (``odc-accelerate launch``) gets an
      `ODCPlugin`.
    * A PEFT model's LM head is grouped with its final norm, as accelerate does for plain models.
    * An accelerate loop that never calls the engine trains with it: accelerate's own step drives it (see
      `drive_steps`).

    `ODCPlugin`, the ODC TRL configs and `ODCTrainerMixin` call it; a script that builds a plain ``Accelerator()``
    under ``odc-accelerate launch`` calls it before creating the accelerator. Call it before the process group is
    created (before ``Accelerator``, ``PartialState`` or the training arguments).
    """
    compat.install(
        on_prepared=_attach_engine,
        before_end_training=_close_engine,
        after_end_training=_release_process_groups,
        default_plugin=odc_plugin_from_env,
        before_clip=_before_clip,
        before_optimizer_step=_before_optimizer_step,
        after_optimizer_step=_after_optimizer_step,
    )


@dataclass
class ODCPlugin(ODCConfig, FullyShardedDataParallelPlugin):
    """FSDP2 plugin that swaps FSDP2's per-layer collectives for ODC's one-sided gathers and scatter-accumulates.

    Pass it as `Accelerator(fsdp_plugin=ODCPlugin(...))`. It takes every field of
    [`~accelerate.utils.FullyShardedDataParallelPlugin`] (``fsdp_version`` is always 2) and every option of
    [`~odc_accelerate.config.ODCConfig`] (``enable`` defaults to `True` here); an option left unset is read from its
    ``ODC_*`` environment variable (set by ``odc-accelerate launch`` from the accelerate config file), then takes its
    default. After ``accelerator.prepare(model, ...)`` the engine is ``get_engine(accelerator)``: call
    ``engine.pre_optimizer_step()`` before gradient clipping / ``optimizer.step()`` and
    ``engine.post_optimizer_step()`` after it.

    ``odc_config`` passes options already resolved (the ODC Trainer passes its own ``odc_config``): the plugin then
    takes them as they are, with no option argument beside it, and resolves nothing. Either way the plugin holds the
    one resolved `ODCConfig` as ``odc_config`` and its ODC fields are that config's values, read-only like it.

    ``odc=`` and ``balance=`` are deprecated spellings of ``enable=`` and ``plan=``.
    """

    odc_config: ODCConfig | None = field(default=None, repr=False, compare=False)
    odc: InitVar[bool | None] = None
    balance: InitVar[str | None] = None

    # Read-only once built: the ODC options and the config they come from; accelerate's FSDP fields stay its own.
    _read_only_names: ClassVar[frozenset[str] | None] = frozenset([f.name for f in fields(ODCConfig)] + ["odc_config"])

    def __post_init__(self, odc: bool | None = None, balance: str | None = None) -> None:  # type: ignore[override]
        import warnings

        if odc is not None:
            warnings.warn("ODCPlugin(odc=...) is deprecated; use ODCPlugin(enable=...).", FutureWarning, 3)
            self.enable = self.enable if self.enable is not None else odc
        if balance is not None:
            warnings.warn("ODCPlugin(balance=...) is deprecated; use ODCPlugin(plan=...).", FutureWarning, 3)
            self.plan = self.plan if self.plan is not None else balance
        if self.fsdp_version is not None and int(self.fsdp_version) != 2:
            raise ValueError(
                f"ODC runs on FSDP2 only, got fsdp_version={self.fsdp_version}. Set `fsdp_version: 2` in the accelerate "
                "config (FSDP1 and DDP are not supported)."
            )
        self.fsdp_version = 2
        explicit = {f.name: getattr(self, f.name) for f in option_fields()}
        if self.odc_config is None:
            self.odc_config = ODCConfig.from_sources(overrides=explicit, enable_default=True)
        else:
            both = sorted(name for name, value in explicit.items() if value is not None)
            if both:
                raise TypeError(
                    f"ODCPlugin got odc_config and ODC option(s) {', '.join(both)}: pass the options in the config "
                    "(dataclasses.replace(config, ...)) or as arguments, not both."
                )
        config = self.odc_config
        for name, value in config.options().items():
            setattr(self, name, value)
        self.source, self.given = config.source, config.given
        enable()
        FullyShardedDataParallelPlugin.__post_init__(self)
        self._freeze()


#: The options an ODC Trainer resolved, while it builds its accelerator (`resolved_options`).
_TRAINER_CONFIG: contextvars.ContextVar[ODCConfig | None] = contextvars.ContextVar("odc_trainer_config", default=None)


@contextlib.contextmanager
def resolved_options(config: ODCConfig) -> Iterator[None]:
    """Within the block, a plain ``Accelerator()`` under ``odc-accelerate launch`` takes ``config`` (a trainer's own
    resolved options) instead of resolving the environment again (`odc_plugin_from_env`)."""
    token = _TRAINER_CONFIG.set(config)
    try:
        yield
    finally:
        _TRAINER_CONFIG.reset(token)


def odc_plugin_from_env() -> ODCPlugin | None:
    """The plugin ``odc-accelerate launch`` asks for through ``ODC_ENABLE=true``, else `None`.

    Inside `resolved_options` (an ODC Trainer building its accelerator) the trainer's options decide instead.
    """
    config = _TRAINER_CONFIG.get()
    if config is None:
        config = ODCConfig.from_sources()  # the environment alone: what the launcher exported
    if not config.enable:
        return None
    version = (
        os.environ.get("FSDP_VERSION", "2") if str_to_bool(os.environ.get("ACCELERATE_USE_FSDP", "false")) else None
    )
    if version is None:
        raise ValueError(
            "ODC_ENABLE=true but the launch is not FSDP: ODC needs `distributed_type: FSDP` and `fsdp_version: 2` in "
            "the accelerate config."
        )
    return ODCPlugin(fsdp_version=int(version), odc_config=config)


_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_engine(accelerator: Any) -> Any:
    """The `ODCEngine` attached to `accelerator`'s FSDP2 model, or `None` when ODC is off or no model was prepared."""
    return _ENGINES.get(accelerator)


def _attach_engine(accelerator: Any, model: Any) -> None:
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if not isinstance(plugin, ODCPlugin) or not plugin.enable:
        return
    if accelerator in _ENGINES:
        # A second model (e.g. a frozen reference model) keeps FSDP2's own collectives.
        logger.info(
            "ODC engine already attached to the first prepared model; %s keeps FSDP2 collectives.", type(model)
        )
        return
    from ..engine import ODCEngine
    from .trainer.moe import check_transformers_distributed

    check_transformers_distributed(model)  # a plain accelerate loop's model, before the engine serves any group
    config = plugin.odc_config
    engine = ODCEngine(
        model,
        transport=config.transport,
        timeout=config.timeout,
        memory_policy=config.memory_policy,
        memory_headroom=config.memory_headroom,
        reduction=config.reduction,
    )
    if compat.sync_each_batch(accelerator) and engine.may_keep_grads():
        # Decided from the policy as configured (the same on every rank), before any step: `auto` chooses per rank
        # and step, so its choice of the moment cannot decide without refusing on some ranks only.
        engine.close()
        raise ValueError(
            f"accelerate's sync_each_batch=True asks for a reduce after every microbatch, but odc_memory_policy="
            f"{config.memory_policy} keeps unsharded gradients through the step"
            + (" where a rank's free memory allows" if config.memory_policy == "auto" else "")
            + ". With ODC the memory policy decides: drop sync_each_batch, or set odc_memory_policy to neither (or "
            "params)."
        )
    _ENGINES[accelerator] = engine
    logger.info("ODC engine attached (transport=%s, %d param groups).", config.transport, len(engine.param_groups))
    if accelerator not in _CALLER_DRIVEN and accelerator.is_main_process:
        report = engine.report()
        logger.warning(
            "ODC on: %s (transport: %s). Step calls follow accelerate's: pre_optimizer_step at the step's first "
            "accelerator.clip_grad_norm_ or optimizer.step, post_optimizer_step after optimizer.step; a loop that "
            "calls them itself keeps them.",
            report.describe(),
            report.transport_reason,
        )


# ------------------------------------------------------------------ the step calls of an unmodified accelerate loop
_CALLER_DRIVEN: weakref.WeakSet = weakref.WeakSet()  # accelerators whose caller makes the engine's step calls
_STARTED: weakref.WeakSet = weakref.WeakSet()  # accelerators whose current step accelerate's clip / step started
# AcceleratedOptimizer -> a weak reference to its accelerator (which holds the optimizer: a strong one would keep both)
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def drive_steps(accelerator: Any, enabled: bool = True) -> None:
    """Whether accelerate's own step calls drive ``accelerator``'s engine (on by default).

    On, an accelerate loop that never calls the engine trains with ODC unmodified: once a step's gradients are
    complete (accelerate's ``sync_gradients``: the last microbatch of ``accelerator.accumulate``, or every microbatch
    without it), the first of ``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` / ``optimizer.step()`` calls
    ``engine.pre_optimizer_step(optimizer)`` (clipping sees the step's gradients), and ``optimizer.step()`` is followed
    by ``engine.post_optimizer_step()``. A step whose ``pre_optimizer_step`` the loop made itself (the `get_engine`
    loop) is left to it. The ODC trainers switch this off (``enabled=False``): they make both calls themselves.
    Gradients read outside accelerate (``torch.nn.utils.clip_grad_norm_``) before ``optimizer.step()`` are not the
    step's: clip with ``accelerator.clip_grad_norm_``.

    Args:
        accelerator (`accelerate.Accelerator`): the accelerator whose engine (`get_engine`) is concerned.
        enabled (`bool`, *optional*, defaults to `True`): `False` when the caller makes the engine's step calls.
    """
    if enabled:
        _CALLER_DRIVEN.discard(accelerator)
    else:
        _CALLER_DRIVEN.add(accelerator)


def _driven_engine(accelerator: Any) -> Any:
    """``accelerator``'s engine when accelerate's step calls drive it and it is between steps' microbatches."""
    from ..engine.stats import EngineState

    engine = _ENGINES.get(accelerator)
    if engine is None or accelerator in _CALLER_DRIVEN or engine.state is not EngineState.IN_STEP:
        return None  # no engine, the caller drives it, or this step's pre_optimizer_step was made already
    return engine


def _start_step(accelerator: Any, where: str) -> None:
    engine = _driven_engine(accelerator)
    if engine is None:
        return
    optimizers = compat.prepared_optimizers(accelerator)
    if len(optimizers) != 1:
        # The same prepared optimizers on every rank: every rank refuses here, before any step.
        raise ValueError(
            f"ODC drives its optimizer step from accelerate's for one optimizer, but this Accelerator prepared "
            f"{len(optimizers)} ({where} was called): the engine folds the step's gradients once, for one optimizer. "
            "Prepare one optimizer (several param groups are fine), or make the step calls yourself: "
            "engine = odc_accelerate.integrations.accelerate.get_engine(accelerator); engine.pre_optimizer_step() "
            "after the step's last backward, before clipping and the first optimizer.step(); "
            "engine.post_optimizer_step() after the last optimizer.step()."
        )
    engine.pre_optimizer_step(optimizers[0])
    _STARTED.add(accelerator)


def _before_clip(accelerator: Any) -> None:
    if accelerator.sync_gradients:  # clipping a partial accumulation reads what FSDP2 would hold then: nothing yet
        _start_step(accelerator, "accelerator.clip_grad_norm_ / clip_grad_value_")


def _owner(optimizer: Any) -> Any:
    """The accelerator with an engine that prepared ``optimizer``, else `None`."""
    ref = _OWNERS.get(optimizer)
    accelerator = ref() if ref is not None else None
    if accelerator is None:
        for candidate in list(_ENGINES.keys()):
            if any(o is optimizer for o in compat.prepared_optimizers(candidate)):
                _OWNERS[optimizer] = weakref.ref(candidate)
                return candidate
    return accelerator


def _before_optimizer_step(optimizer: Any) -> None:
    accelerator = _owner(optimizer)
    if accelerator is not None:
        _start_step(accelerator, "optimizer.step()")


def _after_optimizer_step(optimizer: Any) -> None:
    accelerator = _owner(optimizer)
    if accelerator is not None and accelerator in _STARTED:
        _STARTED.discard(accelerator)
        engine = _ENGINES.get(accelerator)
        if engine is not None:
            engine.post_optimizer_step()


_FROZEN_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare_frozen_model(accelerator: Any, model: Any) -> Any:
    """Shard a model that is never trained (e.g. DPO's reference model) per layer, like accelerate shards the policy.

    The parameters are frozen (``requires_grad_(False)``) and the model is put in eval mode. Under ODC (an `ODCPlugin`
    with ``enable=True``) the model is served by a gather-only `ODCEngine` (``frozen=True``): a forward reads the peers'
    shards and makes no collective. Under plain FSDP2 it keeps FSDP2's per-layer all-gathers (no reduce-scatter ever
    runs). Collective: every rank calls it with the same model. The engine is closed by
    ``accelerator.end_training()`` or by `release_frozen_model`.
    """
    from accelerate.utils import fsdp2_prepare_model

    model.requires_grad_(False)
    model = fsdp2_prepare_model(
        accelerator, model
    )  # accelerate's own per-layer wrapping, not our engine-attaching hook
    model.eval()
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if isinstance(plugin, ODCPlugin) and plugin.enable:
        from ..engine import ODCEngine

        config = plugin.odc_config
        engine = ODCEngine(
            model,
            transport=config.transport,
            timeout=config.timeout,
            frozen=True,
            memory_policy=config.memory_policy,
            memory_headroom=config.memory_headroom,
        )
        _FROZEN_ENGINES.setdefault(accelerator, []).append(engine)
        logger.info("ODC gather-only engine attached to a frozen %s.", type(model).__name__)
    return model


def get_frozen_engines(accelerator: Any) -> list[Any]:
    """The gather-only engines of the frozen models `prepare_frozen_model` prepared for ``accelerator``."""
    return [e for e in _FROZEN_ENGINES.get(accelerator, []) if e.transport is not None]


def release_frozen_model(accelerator: Any, model: Any) -> None:
    """Close the gather-only engine serving ``model`` (its shared memory is freed). Collective."""
    engines = _FROZEN_ENGINES.get(accelerator, [])
    for engine in [e for e in engines if e.model is model]:
        engine.close()
        engines.remove(engine)


_BEFORE_END: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def call_before_end_training(accelerator: Any, fn: Any) -> None:
    """Call ``fn()`` when ``accelerator.end_training()`` starts, before the ODC engines close and the process group is
    destroyed (e.g. to shut down a vLLM engine that joined the job's process group). Once; in registration order."""
    _BEFORE_END.setdefault(accelerator, []).append(fn)


def _close_engine(accelerator: Any) -> None:
    """Run the before-end callbacks, then close ``accelerator``'s ODC engines, whatever raised before.

    A callback that fails (e.g. a vLLM engine's shutdown) must not leave the engines open: their shared memory would
    outlive the run, and the peers would wait for this rank's engine. Every callback runs and every engine is closed;
    then the first error is raised (the others are logged).
    """
    error: BaseException | None = None

    def call(fn: Any, what: str) -> None:
        nonlocal error
        try:
            fn()
        except BaseException as err:  # raised once everything is closed
            if error is None:
                error = err
            else:
                logger.error("%s failed too at end_training: %r", what, err)

    for fn in _BEFORE_END.pop(accelerator, []):
        call(fn, "A callback before end_training")
    engine = _ENGINES.pop(accelerator, None)
    for closing in ([engine] if engine is not None else []) + _FROZEN_ENGINES.pop(accelerator, []):
        call(closing.close, "Closing an ODC engine")
    if error is not None:
        raise error


def _release_process_groups(accelerator: Any) -> None:
    """Once ``end_training`` destroyed the process group, free it, so that gloo joins its worker threads now.

    ``destroy_process_group()`` leaves gloo's workers running while FSDP2 modules and device meshes still reference
    the group. A worker that finishes a collective's clean-up while the interpreter finalises takes the GIL, is made
    to exit and aborts the process (SIGABRT after training and saving succeeded; pytorch/pytorch#190489).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return  # not destroyed (e.g. a notebook_launcher run): the groups are still in use
    mesh = getattr(accelerator.state, "device_mesh", None)
    try:
        from .._compat.torch import c10d as c10d_compat

        n = c10d_compat.release_process_groups([mesh] if mesh is not None else [])
    except RuntimeError as err:  # CompatError: this torch lacks an internal it reads (raised at import too)
        # Training and saving are done: a warning, not an error that would fail a finished run.
        logger.warning("%s Without it gloo's worker threads may outlive end_training (rare abort at exit).", err)
        return
    logger.debug("Released %d process-group references after end_training.", n)
