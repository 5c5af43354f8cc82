"""Push the weights of a model trained with ODC to a vLLM server (TRL's ``vllm_mode="server"``), from rank 0 alone.

Rank 0 reads every full weight from the published shards (`~odc_accelerate.integrations.vllm.iter_checkpoint_units`:
ODC's transport reads, no torch.distributed call) and hands them to the server one FSDP unit at a time; the other
ranks take no part. Two channels, by the trainer's device:

* ``"nccl"`` (CUDA): TRL's own `trl.generation.vllm_client.VLLMClient`, joined to the server's NCCL weight-transfer
  engine by TRL (``init_communicator``), one ``update_named_params`` broadcast per unit inside one ``weight_update()``;
* ``"file"`` (any other device, e.g. CPU, where vLLM's weight-transfer engines, NCCL or CUDA IPC, cannot run): each
  unit is written as one safetensors file in a directory the server can read (the trainer's output directory), and
  the server reloads them in place (vLLM's ``reload_weights(weights_path=...)`` through its ``/collective_rpc``
  development endpoint, `odc_accelerate._compat.vllm.reload_server_weights`); the files are removed after.

Either way TRL's ``reset_prefix_cache()`` follows. See docs/integrations.md, "vLLM server mode".
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from ..engine import ODCEngine
from .vllm import VLLMSyncStats, _check_engine, iter_checkpoint_units

__all__ = ["SERVER_CHANNELS", "push_weights_to_server", "server_channel"]

#: The channels `push_weights_to_server` can use (see the module docstring).
SERVER_CHANNELS = ("nccl", "file")
#: Where the ``"file"`` channel writes, under the trainer's output directory.
WEIGHTS_DIR = "odc_vllm_server_weights"


def server_channel(device: Any) -> str:
    """The channel for a trainer on ``device``: ``"nccl"`` on CUDA (TRL's weight-transfer engine), ``"file"``
    elsewhere."""
    return "nccl" if getattr(device, "type", str(device)) == "cuda" else "file"


def push_weights_to_server(
    client: Any, engine: ODCEngine, channel: str, weights_dir: str | None = None
) -> VLLMSyncStats:
    """Load the current weights of the model that ``engine`` serves into the vLLM server behind ``client``.

    Call it on one rank (TRL's main process, which holds the client), between optimizer steps; it makes no
    torch.distributed call, so the other ranks go on (to the step's prompt gather, where they wait for it).

    Args:
        client (`trl.generation.vllm_client.VLLMClient`): TRL's client of the server.
        engine (`ODCEngine`): the engine serving the trained model.
        channel (`str`): ``"nccl"`` or ``"file"`` (`server_channel`).
        weights_dir (`str`, *optional*): for ``"file"``, the directory to write the weights in (created, emptied
            first, removed after); the server must be able to read it.

    Returns:
        `VLLMSyncStats`: what the sync cost this rank (``loaded`` stays 0: the server does not report what it
        loaded).

    Raises:
        ValueError: an unknown channel, or ``"file"`` without ``weights_dir``.
        RuntimeError: the engine is inside an optimizer step, or the server refused the update.
    """
    if channel not in SERVER_CHANNELS:
        raise ValueError(f"unknown vLLM server channel {channel!r}; expected one of {SERVER_CHANNELS}")
    if channel == "file" and not weights_dir:
        raise ValueError("the 'file' channel needs a weights_dir the vLLM server can read")
    _check_engine(engine)
    stats = VLLMSyncStats()
    start = time.perf_counter()
    if channel == "nccl":
        _push_nccl(client, engine, stats)
    else:
        _push_files(client, engine, stats, str(weights_dir))
    client.reset_prefix_cache()
    stats.seconds = time.perf_counter() - start
    return stats


def _push_nccl(client: Any, engine: ODCEngine, stats: VLLMSyncStats) -> None:
    from .._compat.trl import grpo as trl_grpo

    with trl_grpo.vllm_client_weight_update(client):
        for weights in iter_checkpoint_units(engine, stats):
            metadata = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in weights]
            client.update_named_params(metadata, iter(weights))


def _push_files(client: Any, engine: ODCEngine, stats: VLLMSyncStats, weights_dir: str) -> None:
    from safetensors.torch import save_file

    from .._compat import vllm as vllm_compat

    shutil.rmtree(weights_dir, ignore_errors=True)
    os.makedirs(weights_dir)
    try:
        for i, weights in enumerate(iter_checkpoint_units(engine, stats)):
            # One file per unit: one unit held at a time. A tied weight comes under each of its names (the layerwise
            # reload needs the head's own), which safetensors refuses as shared memory: each name gets its own copy.
            seen: set[int] = set()
            tensors = {}
            for name, tensor in weights:
                ptr = tensor.untyped_storage().data_ptr()
                tensors[name] = tensor.clone() if ptr in seen else tensor.contiguous()
                seen.add(ptr)
            save_file(tensors, os.path.join(weights_dir, f"unit-{i:05d}.safetensors"))
        vllm_compat.reload_server_weights(client.session, client.base_url, os.path.abspath(weights_dir))
    finally:
        shutil.rmtree(weights_dir, ignore_errors=True)
