"""Per-rank worker of the tied-embedding wrapping test (run through :func:`odc_accelerate.testing.launch`).

accelerate 1.14's ``fsdp2_prepare_model`` (a supported release) wraps a model whose LM head is its input embedding
as: every decoder layer, then the tail group ``[final norm, input embedding]``, then the root, each with
``torch.distributed.fsdp.fully_shard`` looked up when the function runs. The LM head is left to the root, which
`odc_accelerate._compat.accelerate._tied_embeddings_in_one_group` corrects. The worker replays that sequence on the tied
tiny model, without and with the correction, and compares one forward and backward with the same model in one
process.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.distributed as dist


def _wrap_as_accelerate_1_14(model: Any, mesh: Any) -> None:
    """The ``fully_shard`` calls of accelerate 1.14's ``fsdp2_prepare_model`` for a tied model (no auto-wrap of the
    embedding: it goes to the tail group, whose ``reshard_after_forward`` is False)."""
    from torch.distributed import fsdp  # the name accelerate imports inside the function, at each call

    for layer in model.model.layers:
        fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard([model.model.norm, model.get_input_embeddings()], mesh=mesh, reshard_after_forward=False)
    fsdp.fully_shard(model, mesh=mesh)


def _loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def wrap_tied_model(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """`wrap_tied_model_once` without the correction (``"uncorrected"``), then with it (``"corrected"``)."""
    return {"uncorrected": wrap_tied_model_once(False), "corrected": wrap_tied_model_once(True)}


def wrap_tied_model_once(corrected: bool) -> dict[str, Any]:
    """Wrap the tied tiny model as accelerate 1.14 does (inside the correction when ``corrected``), then run one
    forward and backward of a fixed batch. Returns the error if the wrapping or the first forward raised, whether the
    LM head still is the input embedding, and the loss and the tied weight's full gradient next to those of the
    unwrapped model."""
    from transformers import AutoModelForCausalLM, set_seed

    from odc_accelerate._compat.accelerate import _tied_embeddings_in_one_group
    from odc_accelerate.testing.models import tiny_causal_lm_config, world_mesh

    set_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_causal_lm_config("tied", hidden_size=32), dtype=torch.float32)
    reference = copy.deepcopy(model)  # deepcopy keeps the tie
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    expected_loss = _loss(reference, ids)
    expected_loss.backward()
    block = _tied_embeddings_in_one_group(model) if corrected else contextlib.nullcontext()
    try:
        with block:
            _wrap_as_accelerate_1_14(model, world_mesh("cpu"))
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        loss = _loss(model, ids)  # FSDP2 checks its groups at the first forward (lazy init)
        loss.backward()
    except Exception as err:  # noqa: BLE001 - the test reads which error it was
        return {"error": f"{type(err).__name__}: {err}"}
    grad = model.model.embed_tokens.weight.grad
    grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    dist.barrier()
    return {  # numpy: a tensor would cross the result queue as a shared-memory handle that dies with this process
        "error": None,
        "tied": tied,
        "loss": float(loss.detach()),
        "expected_loss": float(expected_loss.detach()),
        "grad": grad.detach().numpy().copy(),
        "expected_grad": reference.model.embed_tokens.weight.grad.detach().numpy().copy(),
    }
