"""Every accelerate internal that odc_accelerate reads or patches, in one place, checked against the installed version.

Importing this module patches nothing: :func:`install` patches, :func:`uninstall` puts the originals back. The patches
serve FSDP2 on CPU, the engine's creation after ``fsdp2_prepare_model``, the step calls of an unmodified loop,
teardown, PEFT models' LM head grouping, tied embeddings and the layer classes to wrap (those of
``_no_split_modules`` the model has); the command line reads ``accelerate launch``'s parser and
config helpers without patching (:func:`check_launch`). Each patch and why: docs/versions.md, "What `_compat/` pins".
The tested versions are ``TESTED["accelerate"]`` in :mod:`odc_accelerate._compat`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..validation import str_to_bool
from . import (
    CompatError,
    check_signature,
    installed_version,
    is_patched,
    missing_message,
    patch_attribute,
    patched_attribute,
    require,
    restore_attribute,
    tested_text,
    warn_if_untested,
)

logger = logging.getLogger(__name__)

__all__ = [
    "check_launch",
    "default_config_file",
    "evaluation_models_prepared_by",
    "install",
    "launch_parser",
    "load_config_file",
    "prepared_optimizers",
    "sync_each_batch",
    "syncs_gradients",
    "uninstall",
]

_LIBRARY = "accelerate"


@dataclass
class _Callbacks:
    """What the installed wrappers call; replaced by every :func:`install`."""

    on_prepared: Callable[[Any, Any], None] | None = None
    before_end_training: Callable[[Any], None] | None = None
    after_end_training: Callable[[Any], None] | None = None
    default_plugin: Callable[[], Any] | None = None
    before_clip: Callable[[Any], None] | None = None
    before_optimizer_step: Callable[[Any], None] | None = None
    after_optimizer_step: Callable[[Any], None] | None = None


_CALLBACKS = _Callbacks()


def _require(obj: Any, attr: str, where: str) -> Any:
    return require(obj, attr, library=_LIBRARY, where=where)


# What the launcher reads from a parse by `launch_parser`: destination -> what it holds.
_LAUNCH_DESTS = {
    "training_script": "the script (or module) to run",
    "training_script_args": "the script's arguments (argparse.REMAINDER)",
    "module": "--module",
    "no_python": "--no_python",
    "config_file": "--config_file",
}


def launch_parser() -> argparse.ArgumentParser:
    """accelerate's ``accelerate launch`` parser (``accelerate.commands.launch.launch_command_parser``).

    Raises:
        CompatError: the function is missing, or its parser lacks a destination the launcher reads.
    """
    from accelerate.commands import launch as launch_mod

    parser = _require(launch_mod, "launch_command_parser", "accelerate.commands.launch")()
    dests = {action.dest for action in parser._actions}
    for dest, what in _LAUNCH_DESTS.items():
        if dest not in dests:
            raise CompatError(
                missing_message(
                    f"accelerate.commands.launch.launch_command_parser().{dest}",
                    library=_LIBRARY,
                    advice=f"The launcher reads {what} from it.",
                )
            )
    return parser


def default_config_file() -> str:
    """The path of accelerate's default config file (``accelerate config`` writes it, ``accelerate launch`` reads it
    without ``--config_file``), as accelerate computes it (``HF_HOME`` / ``XDG_CACHE_HOME``)."""
    from accelerate.commands import config as config_mod

    return str(_require(config_mod, "default_config_file", "accelerate.commands.config"))


def load_config_file(path: str) -> Any:
    """Load (and so check) an accelerate config file as ``accelerate launch`` does."""
    from accelerate.commands import config as config_mod

    return _require(config_mod, "load_config_from_file", "accelerate.commands.config")(config_file=path)


def check_launch() -> None:
    """Raise `~odc_accelerate._compat.CompatError` if an accelerate command-line internal the launcher reads is
    missing or changed shape (run at the start of ``odc-accelerate launch`` and ``config``)."""
    from accelerate.commands import config as config_mod

    warn_if_untested(_LIBRARY, "The launcher reads accelerate's launch parser, which may differ there.")
    launch_parser()
    default_config_file()
    load = _require(config_mod, "load_config_from_file", "accelerate.commands.config")
    check_signature(load, ("config_file",), library=_LIBRARY, where="accelerate.commands.config.load_config_from_file")


def _env_true(name: str) -> bool:
    """Whether an environment variable holds a true value (accelerate's spellings: true/1/yes/on)."""
    return str_to_bool(os.environ.get(name, "false"), name)


def _launched_multiprocess() -> bool:
    return int(os.environ.get("LOCAL_RANK", -1)) != -1 and int(os.environ.get("WORLD_SIZE", 1)) > 1


@dataclass(frozen=True)
class _Target:
    """One internal that :func:`install` wraps."""

    owner: Any
    name: str
    where: str  # how messages name the owner
    wrap: Callable[[Callable], Callable]  # builds the wrapper from the original
    params: tuple[str, ...]  # parameters the wrapper passes by keyword or reads from the caller's arguments


def _targets() -> list[_Target]:
    import accelerate.accelerator as accelerator_mod
    from accelerate import Accelerator
    from accelerate import optimizer as optimizer_mod
    from accelerate import state as state_mod
    from accelerate.utils import fsdp_utils

    partial_state = _require(state_mod, "PartialState", "accelerate.state")
    accel_state = _require(state_mod, "AcceleratorState", "accelerate.state")
    _require(partial_state, "_shared_state", "accelerate.state.PartialState")
    wrap_state_init = functools.partial(_wrap_state_init, partial_state=partial_state)
    accelerated_optimizer = _require(optimizer_mod, "AcceleratedOptimizer", "accelerate.optimizer")
    from accelerate.utils import FullyShardedDataParallelPlugin

    return [
        _Target(
            partial_state,
            "_prepare_backend",
            "accelerate.state.PartialState",
            _wrap_prepare_backend,
            ("cpu", "sagemaker_dp", "backend"),
        ),
        _Target(accel_state, "__init__", "accelerate.state.AcceleratorState", wrap_state_init, ("fsdp_plugin",)),
        _Target(fsdp_utils, "_find_final_norm", "accelerate.utils.fsdp_utils", _wrap_find_final_norm, ("model",)),
        _Target(
            FullyShardedDataParallelPlugin,
            "set_auto_wrap_policy",
            "accelerate.utils.FullyShardedDataParallelPlugin",
            _wrap_set_auto_wrap_policy,
            ("model",),
        ),
        _Target(
            accelerator_mod,
            "fsdp2_prepare_model",
            "accelerate.accelerator",
            _wrap_prepare_model,
            ("accelerator", "model"),
        ),
        _Target(Accelerator, "end_training", "accelerate.Accelerator", _wrap_end_training, ()),
        _Target(Accelerator, "__init__", "accelerate.Accelerator", _wrap_accelerator_init, ("fsdp_plugin",)),
        _Target(Accelerator, "clip_grad_norm_", "accelerate.Accelerator", _wrap_clip, ("parameters",)),
        _Target(Accelerator, "clip_grad_value_", "accelerate.Accelerator", _wrap_clip, ("parameters",)),
        _Target(
            accelerated_optimizer,
            "step",
            "accelerate.optimizer.AcceleratedOptimizer",
            _wrap_optimizer_step,
            ("closure",),
        ),
    ]


def install(
    *,
    on_prepared: Callable[[Any, Any], None] | None = None,
    before_end_training: Callable[[Any], None] | None = None,
    after_end_training: Callable[[Any], None] | None = None,
    default_plugin: Callable[[], Any] | None = None,
    before_clip: Callable[[Any], None] | None = None,
    before_optimizer_step: Callable[[Any], None] | None = None,
    after_optimizer_step: Callable[[Any], None] | None = None,
) -> None:
    """Patch accelerate for ODC: FSDP2 on CPU, the PEFT final norm, and the callbacks.

    Idempotent: each internal is wrapped once however often this is called; every call replaces all the callbacks
    (a callback left `None` is not called). Call it before the process group is created (before ``Accelerator``,
    ``PartialState`` or the Trainer's arguments), so that the CPU patches see the launch.

    Args:
        on_prepared (`Callable[[Accelerator, nn.Module], None]`, *optional*):
            Called every time accelerate has just FSDP2-wrapped a model (``fsdp2_prepare_model`` returned).
        before_end_training (`Callable[[Accelerator], None]`, *optional*):
            Called at the start of ``Accelerator.end_training``, while the process group exists.
        after_end_training (`Callable[[Accelerator], None]`, *optional*):
            Called once ``Accelerator.end_training`` has returned (the process group is destroyed).
        default_plugin (`Callable[[], FullyShardedDataParallelPlugin | None]`, *optional*):
            When ``Accelerator()`` gets no ``fsdp_plugin`` (and no positional arguments) and the launch asked for
            FSDP (``ACCELERATE_USE_FSDP``), its result, if not `None`, is used as the plugin. This is how
            environment-only configuration (``odc-accelerate launch`` exports ``ODC_*`` variables) reaches code that
            builds a plain ``Accelerator()``.
        before_clip (`Callable[[Accelerator], None]`, *optional*):
            Called at the start of ``Accelerator.clip_grad_norm_`` / ``clip_grad_value_``, before any gradient is read.
        before_optimizer_step / after_optimizer_step (`Callable[[AcceleratedOptimizer], None]`, *optional*):
            Called around ``AcceleratedOptimizer.step`` when it steps (accelerate's ``sync_gradients``; on other
            microbatches of an accumulation the step is a no-op and neither is called). ``after_optimizer_step`` is
            not called when the step raised.

    Raises:
        `~odc_accelerate._compat.CompatError`: an internal is missing or its parameters changed; nothing is patched.
    """
    global _CALLBACKS
    targets = _targets()
    if not all(is_patched(t.owner, t.name) for t in targets):
        for t in targets:  # every check before the first patch: a failure leaves accelerate untouched
            original = _require(t.owner, t.name, t.where)
            check_signature(original, t.params, library=_LIBRARY, where=f"{t.where}.{t.name}")
        detail = "The accelerate methods it patches may behave differently there."
        warn_if_untested(_LIBRARY, detail)
    _CALLBACKS = _Callbacks(
        on_prepared,
        before_end_training,
        after_end_training,
        default_plugin,
        before_clip,
        before_optimizer_step,
        after_optimizer_step,
    )
    for t in targets:
        patch_attribute(t.owner, t.name, t.wrap, library=_LIBRARY, where=t.where)


def uninstall() -> None:
    """Put back every original that :func:`install` replaced and forget the callbacks. Idempotent."""
    global _CALLBACKS
    for t in _targets():
        restore_attribute(t.owner, t.name)
    _CALLBACKS = _Callbacks()


# ----------------------------------------------------------------------------------------------------------- wrappers
def _wrap_prepare_backend(original: Callable) -> Callable:
    from accelerate.utils import DistributedType

    @functools.wraps(original)
    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None):
        chosen_backend, distributed_type = original(self, cpu=cpu, sagemaker_dp=sagemaker_dp, backend=backend)
        if (
            distributed_type == DistributedType.NO
            and _launched_multiprocess()
            and _env_true("ACCELERATE_USE_FSDP")
            and backend in (None, "gloo")
        ):
            # A launcher started several processes for FSDP, but there is no GPU: without this every process would
            # silently train its own copy of the model.
            logger.info("FSDP requested on a machine without accelerator devices: using gloo on CPU.")
            return "gloo", DistributedType.MULTI_CPU
        return chosen_backend, distributed_type

    return _prepare_backend


def _wrap_state_init(original: Callable, *, partial_state: Any) -> Callable:
    from accelerate.utils import DistributedType

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if getattr(self, "distributed_type", None) != DistributedType.MULTI_CPU:
            return
        plugin = kwargs.get("fsdp_plugin")
        if plugin is None and _env_true("ACCELERATE_USE_FSDP"):
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

    return __init__


def _wrap_find_final_norm(original: Callable) -> Callable:
    # ``fsdp2_prepare_model`` puts ``[final_norm, lm_head]`` in one FSDP2 group, so that the norm's forward unshards
    # the LM head before TRL's fused LM head reads ``lm_head.weight`` directly. ``_find_final_norm`` only looks at
    # ``model.<base_model_prefix>``'s children, which on a ``PeftModel`` is the ``*ForCausalLM`` (no norm there): the
    # head then sits alone in a group no forward ever unshards, and every fused-head forward all-gathers it with
    # ``DTensor.full_tensor()`` (a collective per microbatch; with ODC's unequal microbatch counts, a hang), and its
    # gradient comes back through that gather, not through FSDP2's (or ODC's) reduction: wrong. The wrapper looks
    # through ``get_base_model()`` first. A vision-language model's final norm is its language model's
    # (``model.language_model.norm`` in Qwen3-VL, whose base model holds ``visual`` and ``language_model``): where the
    # base model has none, the decoder's (``get_decoder()``) children are searched the same way.
    @functools.wraps(original)
    def _find_final_norm(model: Any) -> Any:
        import torch

        unwrap = getattr(model, "get_base_model", None)
        model = unwrap() if callable(unwrap) else model
        found = original(model=model)
        get_decoder = getattr(model, "get_decoder", None)
        decoder = get_decoder() if found is None and callable(get_decoder) else None
        if isinstance(decoder, torch.nn.Module) and decoder is not model:
            for module in decoder.children():
                if "Norm" in type(module).__name__:  # accelerate's own test, on the decoder's children
                    found = module
        return found

    return _find_final_norm


def _wrap_prepare_model(original: Callable) -> Callable:
    @functools.wraps(original)
    def fsdp2_prepare_model(accelerator: Any, model: Any) -> Any:
        with _present_layer_classes(accelerator, model), _tied_embeddings_in_one_group(model):
            model = original(accelerator=accelerator, model=model)
        if _CALLBACKS.on_prepared is not None:
            _CALLBACKS.on_prepared(accelerator, model)
        return model

    return fsdp2_prepare_model


_DROPPED_LOGGED: set[tuple[str, tuple[str, ...]]] = set()
# Set on a plugin whose transformer_cls_names_to_wrap this module filled in for the model being prepared.
_RESOLVED = "_odc_resolved_wrap_names"


def _resolve_wrap_names(plugin: Any, model: Any) -> None:
    """Give a ``TRANSFORMER_BASED_WRAP`` plugin without ``transformer_cls_names_to_wrap`` the classes of
    ``model._no_split_modules`` that ``model`` has (see :func:`_present_layer_classes`); anything else is left as is."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = getattr(plugin, "auto_wrap_policy", None)
    policy = policy.func if isinstance(policy, functools.partial) else policy
    names = getattr(model, "_no_split_modules", None)
    if policy is not transformer_auto_wrap_policy or plugin.transformer_cls_names_to_wrap is not None or not names:
        return
    present = {type(module).__name__ for module in model.modules()}
    kept = [name for name in names if name in present]
    dropped = tuple(sorted(name for name in names if name not in present))
    if dropped:
        key = (type(model).__name__, dropped)
        if key not in _DROPPED_LOGGED:
            _DROPPED_LOGGED.add(key)
            logger.warning(
                "%s lists %s in _no_split_modules but has no such module: FSDP2 wraps %s only (set "
                "fsdp_transformer_layer_cls_to_wrap to choose the classes).",
                type(model).__name__,
                ", ".join(dropped),
                ", ".join(kept) if kept else "the model as one group",
            )
    plugin.transformer_cls_names_to_wrap = kept
    setattr(plugin, _RESOLVED, True)


@contextlib.contextmanager
def _present_layer_classes(accelerator: Any, model: Any) -> Iterator[None]:
    """Within the block, a ``TRANSFORMER_BASED_WRAP`` plugin without ``transformer_cls_names_to_wrap`` wraps the
    classes of ``model._no_split_modules`` that ``model`` has; afterwards the plugin names none again.

    accelerate wraps every name of ``_no_split_modules`` and raises ("Could not find the transformer layer class") on
    the first the model lacks: transformers lists ``Qwen3_5MoeVisionBlock`` there for the text-only
    ``Qwen3_5MoeForCausalLM``, which has none. Names the model lacks are dropped, said once per model class; a class
    the user named is left to accelerate. ``Accelerator._prepare_fsdp2`` reads the names before
    ``fsdp2_prepare_model`` (``set_auto_wrap_policy``, wrapped to call :func:`_resolve_wrap_names` too), and this
    block ends the preparation: each model prepared with the plugin (a policy and its reference) is wrapped by its
    own classes.
    """
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if plugin is None:
        yield
        return
    _resolve_wrap_names(plugin, model)
    try:
        yield
    finally:
        if getattr(plugin, _RESOLVED, False):
            plugin.transformer_cls_names_to_wrap = None
            setattr(plugin, _RESOLVED, False)


def _wrap_set_auto_wrap_policy(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_auto_wrap_policy(self: Any, model: Any) -> Any:
        _resolve_wrap_names(self, model)
        return original(self, model)

    return set_auto_wrap_policy


def _tied_embeddings(model: Any) -> tuple[Any, Any] | None:
    """``(input embedding, output embedding)`` of ``model`` when they share one weight (``tie_word_embeddings``),
    else `None`."""
    inputs = getattr(model, "get_input_embeddings", lambda: None)()
    outputs = getattr(model, "get_output_embeddings", lambda: None)()
    weight = getattr(inputs, "weight", None)
    if weight is None or outputs is None or getattr(outputs, "weight", None) is not weight:
        return None
    return inputs, outputs


@contextlib.contextmanager
def _tied_embeddings_in_one_group(model: Any) -> Iterator[None]:
    """Within the block (``fsdp2_prepare_model``), the FSDP2 group holding a tied input embedding holds the output
    embedding too; after it, the two still share one (sharded) parameter, or `CompatError` is raised.

    A tied weight must be sharded by one ``fully_shard`` call that holds both modules: FSDP2 replaces the parameter on
    every module of its group that holds it. accelerate 1.14 puts only the input embedding in the tail group
    ``[final_norm, embedding]`` and leaves the LM head to the root, so the tail replaces ``embed_tokens.weight`` with
    its sharded parameter and ``lm_head.weight`` keeps the original one: torch 2.13 refuses that ("shared with a
    parameter already managed by another FSDP group"), and older torch trains the two as separate weights, silently
    untied. accelerate 1.15 groups ``[final_norm, embedding, lm_head]`` itself (nothing to add then). accelerate
    imports ``fully_shard`` from ``torch.distributed.fsdp`` inside the function, so that name is wrapped for the
    block: a module list holding the input embedding but not the output embedding gets it appended.
    """
    tied = _tied_embeddings(model)
    if tied is None:
        yield
        return
    import torch.distributed.fsdp as fsdp

    inputs, outputs = tied
    original = fsdp.fully_shard

    @functools.wraps(original)
    def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(module, (list, tuple)) and any(m is inputs for m in module):
            if not any(m is outputs for m in module):
                module = [*module, outputs]
        return original(module, *args, **kwargs)

    fsdp.fully_shard = fully_shard
    try:
        yield
    finally:
        fsdp.fully_shard = original
    if inputs.weight is not outputs.weight:
        raise CompatError(
            f"accelerate's FSDP2 wrapping (fsdp2_prepare_model, accelerate {installed_version(_LIBRARY)}) untied the "
            f"input and output embeddings of {type(model).__name__} (tie_word_embeddings): they would train as two "
            "weights. odc_accelerate is tested with accelerate "
            f"{tested_text(_LIBRARY)}; install one of those, or load the model with tie_word_embeddings=False."
        )


def _wrap_end_training(original: Callable) -> Callable:
    @functools.wraps(original)
    def end_training(self: Any) -> None:
        if _CALLBACKS.before_end_training is not None:
            _CALLBACKS.before_end_training(self)
        original(self)
        if _CALLBACKS.after_end_training is not None:
            _CALLBACKS.after_end_training(self)

    return end_training


def _wrap_accelerator_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        make = _CALLBACKS.default_plugin
        if make is not None and kwargs.get("fsdp_plugin") is None and not args and _env_true("ACCELERATE_USE_FSDP"):
            plugin = make()
            if plugin is not None:
                kwargs["fsdp_plugin"] = plugin
        original(self, *args, **kwargs)

    return __init__


def _wrap_clip(original: Callable) -> Callable:
    @functools.wraps(original)
    def clip(self: Any, parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if _CALLBACKS.before_clip is not None:
            _CALLBACKS.before_clip(self)
        return original(self, parameters, *args, **kwargs)

    return clip


def _wrap_optimizer_step(original: Callable) -> Callable:
    @functools.wraps(original)
    def step(self: Any, closure: Any = None) -> Any:
        stepping = syncs_gradients(self)
        if stepping and _CALLBACKS.before_optimizer_step is not None:
            _CALLBACKS.before_optimizer_step(self)
        result = original(self, closure)
        if stepping and _CALLBACKS.after_optimizer_step is not None:
            _CALLBACKS.after_optimizer_step(self)
        return result

    return step


def syncs_gradients(optimizer: Any) -> bool:
    """Whether ``AcceleratedOptimizer.step`` steps now (``optimizer.gradient_state.sync_gradients``: the last
    microbatch of an accumulation, or no accumulation); on the others it is a no-op."""
    state = _require(optimizer, "gradient_state", "accelerate.optimizer.AcceleratedOptimizer")
    return bool(_require(state, "sync_gradients", "accelerate.state.GradientState"))


def prepared_optimizers(accelerator: Any) -> list[Any]:
    """The ``AcceleratedOptimizer``-s ``accelerator.prepare`` made (``Accelerator._optimizers``), in order."""
    return list(_require(accelerator, "_optimizers", "accelerate.Accelerator"))


def sync_each_batch(accelerator: Any) -> bool:
    """Whether ``accelerator`` was built with ``GradientAccumulationPlugin(sync_each_batch=True)`` (or the Trainer's
    ``gradient_accumulation_kwargs``): gradients are asked to be reduced after every microbatch, not only the last."""
    state = _require(accelerator, "gradient_state", "accelerate.Accelerator")
    return bool(_require(state, "plugin_kwargs", "accelerate.state.GradientState").get("sync_each_batch", False))


@contextlib.contextmanager
def evaluation_models_prepared_by(prepare: Callable[[Any, Any, Callable[[Any, Any], Any]], Any]) -> Iterator[None]:
    """Within the block, ``Accelerator.prepare_model(model, evaluation_mode=True)`` returns ``prepare(model,
    accelerator, trl_prepare)``, where ``trl_prepare(model, accelerator)`` is accelerate's own call (a frozen model a
    trainer prepares for inference only: TRL's distillation teacher). Other calls are accelerate's."""
    from accelerate import Accelerator

    where = "accelerate.Accelerator.prepare_model"
    current = _require(Accelerator, "prepare_model", "accelerate.Accelerator")
    check_signature(current, ("model", "evaluation_mode"), library=_LIBRARY, where=where)

    def wrap(original: Callable) -> Callable:
        def own(model: Any, accelerator: Any) -> Any:
            return original(accelerator, model, evaluation_mode=True)

        @functools.wraps(original)
        def prepare_model(self: Any, model: Any, device_placement: Any = None, evaluation_mode: bool = False) -> Any:
            if evaluation_mode:
                return prepare(model, self, own)
            return original(self, model, device_placement=device_placement, evaluation_mode=evaluation_mode)

        return prepare_model

    with patched_attribute(Accelerator, "prepare_model", wrap, library=_LIBRARY, where=where):
        yield
