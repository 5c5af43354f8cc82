"""ODC for `accelerate`: the `ODCPlugin` (an FSDP2 plugin that attaches an `ODCEngine`) and FSDP2 on CPU.

Importing this module lets accelerate run FSDP2 on CPU with gloo (see `odc_accelerate._accelerate_compat`); GPU runs
are untouched.

Custom training loop:

```python
from accelerate import Accelerator
from odc_accelerate.integrations.accelerate import ODCPlugin, get_engine

accelerator = Accelerator(fsdp_plugin=ODCPlugin(max_tokens_per_microbatch=4096))
model, optimizer = accelerator.prepare(model, optimizer)
engine = get_engine(accelerator)  # an ODCEngine, created when accelerate FSDP2-wrapped the model
for step_microbatches in dataloader:  # this rank's microbatches of one step; counts may differ per rank
    for mb in step_microbatches:
        accelerator.backward(loss_of(model, mb))
    engine.pre_optimizer_step()  # one barrier, gradients folded into .grad
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    engine.post_optimizer_step()  # new shards published
accelerator.end_training()  # closes the engine, destroys the process group
```
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

from accelerate.utils import FullyShardedDataParallelPlugin

from .. import _accelerate_compat as compat

logger = logging.getLogger(__name__)

__all__ = [
    "BALANCE_MODES",
    "ODCPlugin",
    "get_engine",
    "get_frozen_engines",
    "odc_plugin_from_env",
    "prepare_frozen_model",
    "release_frozen_model",
]

BALANCE_MODES = ("odc", "lockstep")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name} must be a boolean (true/false), got {value!r}.")


def validate_odc_options(
    transport: Any, timeout: Any, max_tokens_per_microbatch: Any, balance: Any, where: str = "ODC"
) -> None:
    """Raise one `ValueError` naming the option to change when an ODC option is invalid."""
    from ..transport import TRANSPORTS, Transport

    if not isinstance(transport, Transport) and transport not in TRANSPORTS:
        raise ValueError(f"{where}: unknown ODC transport {transport!r}; choose one of {', '.join(TRANSPORTS)}.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"{where}: the ODC timeout must be a positive number of seconds, got {timeout!r}.")
    if max_tokens_per_microbatch is not None and (
        isinstance(max_tokens_per_microbatch, bool)
        or int(max_tokens_per_microbatch) != max_tokens_per_microbatch
        or max_tokens_per_microbatch < 1
    ):
        raise ValueError(
            f"{where}: the ODC token budget per microbatch must be a positive integer, got {max_tokens_per_microbatch!r}."
        )
    if balance not in BALANCE_MODES:
        raise ValueError(f"{where}: unknown ODC balance mode {balance!r}; choose one of {', '.join(BALANCE_MODES)}.")


@dataclass
class ODCPlugin(FullyShardedDataParallelPlugin):
    """FSDP2 plugin that swaps FSDP2's per-layer collectives for ODC's one-sided gathers and scatter-accumulates.

    Pass it as `Accelerator(fsdp_plugin=ODCPlugin(...))`. Every field of
    [`~accelerate.utils.FullyShardedDataParallelPlugin`] is accepted; `fsdp_version` is always 2. After
    `accelerator.prepare(model, ...)` the engine is `plugin.engine` (or `get_engine(accelerator)`); call
    `engine.pre_optimizer_step()` before gradient clipping / `optimizer.step()` and `engine.post_optimizer_step()`
    after it. Each ODC field falls back to an environment variable (set by `odc-accelerate launch` from the
    accelerate config file), then to its default.

    Args:
        odc (`bool`, *optional*, defaults to `True`, env `ODC_ENABLE`):
            Attach the ODC engine. With `False` the plugin behaves as a plain FSDP2 plugin.
        transport (`str`, *optional*, defaults to `"auto"`, env `ODC_TRANSPORT`):
            One of `odc_accelerate.transport.TRANSPORTS`.
        timeout (`float`, *optional*, defaults to 600.0, env `ODC_TIMEOUT`):
            Seconds any ODC wait may last before raising `ODCTimeoutError` naming the missing rank.
        max_tokens_per_microbatch (`int`, *optional*, env `ODC_MAX_TOKENS_PER_MICROBATCH`):
            Token budget of one microbatch for the length-balanced sampler (Trainer integration); `None` lets the
            trainer pick it.
        balance (`str`, *optional*, defaults to `"odc"`, env `ODC_BALANCE`):
            `"odc"` (balanced per-rank totals, free microbatch counts) or `"lockstep"` (equal counts, every slot
            balanced; what plain FSDP2 needs).
    """

    odc: bool | None = field(default=None, metadata={"help": "Attach the ODC engine (env ODC_ENABLE, default true)."})
    transport: str | None = field(
        default=None, metadata={"help": "ODC transport: auto, shm, network, hierarchical or cuda (env ODC_TRANSPORT)."}
    )
    timeout: float | None = field(
        default=None, metadata={"help": "Seconds an ODC wait may last (env ODC_TIMEOUT, default 600)."}
    )
    max_tokens_per_microbatch: int | None = field(
        default=None,
        metadata={
            "help": "Token budget of one microbatch for the balanced sampler (env ODC_MAX_TOKENS_PER_MICROBATCH)."
        },
    )
    balance: str | None = field(
        default=None, metadata={"help": "Step planning: 'odc' or 'lockstep' (env ODC_BALANCE, default odc)."}
    )
    engine: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.fsdp_version is not None and int(self.fsdp_version) != 2:
            raise ValueError(
                f"ODC runs on FSDP2 only, got fsdp_version={self.fsdp_version}. Set `fsdp_version: 2` in the accelerate "
                "config (FSDP1 and DDP are not supported)."
            )
        self.fsdp_version = 2
        if self.odc is None:
            self.odc = _parse_bool(os.environ.get("ODC_ENABLE", "true"), "ODC_ENABLE")
        if self.transport is None:
            self.transport = os.environ.get("ODC_TRANSPORT", "auto")
        if self.timeout is None:
            self.timeout = float(os.environ.get("ODC_TIMEOUT", "600"))
        if self.max_tokens_per_microbatch is None and os.environ.get("ODC_MAX_TOKENS_PER_MICROBATCH"):
            self.max_tokens_per_microbatch = int(os.environ["ODC_MAX_TOKENS_PER_MICROBATCH"])
        if self.balance is None:
            self.balance = os.environ.get("ODC_BALANCE", "odc")
        validate_odc_options(self.transport, self.timeout, self.max_tokens_per_microbatch, self.balance, "ODCPlugin")
        super().__post_init__()


def odc_plugin_from_env() -> ODCPlugin | None:
    """The plugin `odc-accelerate launch` asks for through `ODC_ENABLE=true`, else `None`."""
    if not _parse_bool(os.environ.get("ODC_ENABLE", "false"), "ODC_ENABLE"):
        return None
    version = os.environ.get("FSDP_VERSION", "2") if compat.env_true("ACCELERATE_USE_FSDP") else None
    if version is None:
        raise ValueError(
            "ODC_ENABLE=true but the launch is not FSDP: ODC needs `distributed_type: FSDP` and `fsdp_version: 2` in "
            "the accelerate config."
        )
    return ODCPlugin(fsdp_version=int(version))


_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_engine(accelerator: Any) -> Any:
    """The `ODCEngine` attached to `accelerator`'s FSDP2 model, or `None` when ODC is off or no model was prepared."""
    return _ENGINES.get(accelerator)


def _attach_engine(accelerator: Any, model: Any) -> None:
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if not isinstance(plugin, ODCPlugin) or not plugin.odc:
        return
    if accelerator in _ENGINES:
        # A second model (e.g. a frozen reference model) keeps FSDP2's own collectives.
        logger.info(
            "ODC engine already attached to the first prepared model; %s keeps FSDP2 collectives.", type(model)
        )
        return
    from ..engine import ODCEngine

    engine = ODCEngine(model, transport=plugin.transport, timeout=plugin.timeout)
    plugin.engine = engine
    _ENGINES[accelerator] = engine
    logger.info("ODC engine attached (transport=%s, %d param groups).", plugin.transport, len(engine.param_groups))


_FROZEN_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare_frozen_model(accelerator: Any, model: Any) -> Any:
    """Shard a model that is never trained (e.g. DPO's reference model) per layer, like accelerate shards the policy.

    The parameters are frozen (``requires_grad_(False)``) and the model is put in eval mode. Under ODC (an `ODCPlugin`
    with ``odc=True``) the model is served by a gather-only `ODCEngine` (``frozen=True``): a forward reads the peers'
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
    if isinstance(plugin, ODCPlugin) and plugin.odc:
        from ..engine import ODCEngine

        engine = ODCEngine(model, transport=plugin.transport, timeout=plugin.timeout, frozen=True)
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


def _close_engine(accelerator: Any) -> None:
    engine = _ENGINES.pop(accelerator, None)
    if engine is not None:
        engine.close()
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        if isinstance(plugin, ODCPlugin):
            plugin.engine = None
    for frozen in _FROZEN_ENGINES.pop(accelerator, []):
        frozen.close()


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
        from .. import _fsdp_compat

        n = _fsdp_compat.release_process_groups([mesh] if mesh is not None else [])
    except RuntimeError as err:  # FSDPCompatError: this torch lacks an internal it reads (raised at import too)
        # Training and saving are done: a warning, not an error that would fail a finished run.
        logger.warning("%s Without it gloo's worker threads may outlive end_training (rare abort at exit).", err)
        return
    logger.debug("Released %d process-group references after end_training.", n)


compat.enable_fsdp2_on_cpu()
compat.find_final_norm_through_peft()
compat.on_fsdp2_prepared(_attach_engine)
compat.on_end_training(_close_engine)
compat.on_end_training(_release_process_groups, after=True)
compat.default_fsdp_plugin(odc_plugin_from_env)
