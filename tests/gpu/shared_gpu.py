"""Test-only switch: the ranks of a real ``accelerate launch`` job, any number of them, sharing one GPU over a gloo
process group.

The GPU machines this project's checks run on have one GPU, so the Trainer-level check runs every rank (2 or 8) on
``cuda:0`` (accelerate's ``set_device`` takes the local rank modulo the device count) with ``--ddp_backend gloo``
(NCCL refuses two ranks on one GPU). That set-up trips over four things that a job with one GPU per rank and NCCL
never meets; ``run_example.py`` calls :func:`enable` in each worker when ``ODC_TEST_SHARED_GPU=1``, before the
training script runs. Nothing in it depends on the number of ranks:

* accelerate's ``wait_for_everyone`` calls ``barrier(device_ids=[local_process_index])``: every rank but the first
  names a ``cuda:<rank>`` that does not exist ("invalid device ordinal"). The barrier here uses the current device;
* ``fully_shard`` without ``mesh=`` (what accelerate passes without a parallelism config) builds a default mesh per
  call, and under a gloo default group on a CUDA machine each gets a new process group. Here every such call gets one
  1-D mesh on the world group, as with NCCL;
* ``fsdp_cpu_ram_efficient_loading`` broadcasts CUDA tensors at load time, which gloo cannot do reliably: off;
* gathering a CUDA DTensor over gloo (``full_tensor()``) can crash: parameter dumps (:func:`full_tensor_via_cpu`) and
  the Trainer's full state dict for ``save_model`` gather through CPU. A Trainer checkpoint (``save_fsdp_model``)
  still gathers over gloo and crashed on an H100 (SIGSEGV): the GPU checks run with ``--save_strategy no``.

Nothing here is imported by the package: a user's GPU job runs one rank per GPU, with NCCL.
"""

from __future__ import annotations

import functools
import os
from typing import Any

SWITCH = "ODC_TEST_SHARED_GPU"


def enabled() -> bool:
    return os.environ.get(SWITCH, "0") == "1"


def enable() -> None:
    """Apply the four adjustments of the module docstring to this process (idempotent)."""
    if getattr(enable, "done", False):
        return
    # Read by accelerate's FSDP plugin and by transformers' from_pretrained, both after this point.
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    _barrier_on_current_device()
    _one_default_mesh()
    _full_state_dict_through_cpu()
    enable.done = True


def _barrier_on_current_device() -> None:
    import torch
    import torch.distributed as dist
    from accelerate.state import PartialState

    original = PartialState.wait_for_everyone

    @functools.wraps(original)
    def wait_for_everyone(self: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return original(self)
        on_gpu = torch.cuda.is_available() and self.device.type == "cuda"
        dist.barrier(device_ids=[torch.cuda.current_device()] if on_gpu else None)

    PartialState.wait_for_everyone = wait_for_everyone


def _one_default_mesh() -> None:
    import torch.distributed.fsdp as fsdp

    original = fsdp.fully_shard
    meshes: dict[str, Any] = {}

    @functools.wraps(original)  # also copies ``fully_shard.state`` and the other attributes of the contract
    def fully_shard(module: Any, *args: Any, mesh: Any = None, **kwargs: Any) -> Any:
        if mesh is None:
            import torch
            import torch.distributed as dist
            from torch.distributed.device_mesh import DeviceMesh

            # The device type FSDP2's own default mesh takes: the accelerator if there is one, else CPU.
            accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            device_type = accelerator.type if accelerator is not None else "cpu"
            if device_type not in meshes:
                meshes[device_type] = DeviceMesh.from_group(dist.group.WORLD, device_type)
            mesh = meshes[device_type]
        return original(module, *args, mesh=mesh, **kwargs)

    fsdp.fully_shard = fully_shard


def _full_state_dict_through_cpu() -> None:
    from accelerate import Accelerator

    original = Accelerator.get_state_dict

    @functools.wraps(original)
    def get_state_dict(self: Any, model: Any, unwrap: bool = True) -> dict:
        if not self.is_fsdp2:
            return original(self, model, unwrap=unwrap)
        # Every rank gathers (collective); rank 0 keeps the result, as accelerate's own full state dict does.
        state = {name: full_tensor_via_cpu(value) for name, value in model.state_dict().items()}
        return state if self.is_main_process else {}

    Accelerator.get_state_dict = get_state_dict


def full_tensor_via_cpu(tensor: Any) -> Any:
    """The whole of ``tensor`` on CPU (collective for a DTensor): a DTensor on CPU gathers as it is; one on a GPU moves
    its local shard to CPU first and gathers over a CPU mesh on the same process group (1-D meshes: the shared-GPU
    check's); a plain tensor is copied to CPU."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor.detach().cpu()
    if tensor.device.type == "cpu":
        return tensor.detach().full_tensor()
    mesh = tensor.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"full_tensor_via_cpu gathers GPU tensors over 1-D meshes only, got a {mesh.ndim}-D mesh")
    cpu_mesh = DeviceMesh.from_group(mesh.get_group(), "cpu")
    local = tensor.to_local().detach().cpu()
    whole = DTensor.from_local(
        local, cpu_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )
    return whole.full_tensor()
