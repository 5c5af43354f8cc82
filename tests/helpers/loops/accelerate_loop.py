"""Custom training loop on `Accelerator(fsdp_plugin=ODCPlugin(...))`, run under ``accelerate launch`` by the tests.

Every rank trains a tiny Qwen2 model on fixed random token sequences: rank r runs ``counts[r]`` microbatches per
step (so counts may differ under ODC), with the exact per-token loss scaling. Writes ``result_rank<r>.json`` into
``--out``: how the run was set up (distributed type, plugin class, whether an engine is attached) and the losses and
final parameters (full tensors, gathered) for the tests to compare.

Run with ``--single`` (one plain process) to get the reference on the same global batches. With ``--thread-report``
the model stays referenced until the interpreter exits (as in a script that keeps its trainer in a global) and
``threads_rank<r>.json`` lists this process's threads before ``end_training`` and in the last exit handler.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os

import torch


def _batches(step: int, total: int, seq: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randint(0, vocab, (1, seq), generator=g) for _ in range(total)]


_KEPT: list = []  # --thread-report: objects that live until the interpreter exits


def _thread_names() -> list[str]:
    """Names of this process's threads (Linux), e.g. gloo's ``pt_gloo_runloop`` workers."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return sorted(names)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--counts", default="1,3", help="microbatches per rank per step, comma-separated")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--plugin", choices=["odc", "fsdp2", "env"], default="odc")
    p.add_argument("--single", action="store_true")
    p.add_argument("--transport", default=None)
    p.add_argument("--thread-report", action="store_true")
    p.add_argument(
        "--count-collectives", action="store_true", help="record torch.distributed calls per step (microbatches, sync)"
    )
    args = p.parse_args()
    report: dict = {}
    if args.thread_report:
        # Registered first, so it runs last of all exit handlers, just before the interpreter finalises.
        atexit.register(_write_thread_report, args.out, report)

    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, set_seed
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from odc_accelerate import loss_scale
    from odc_accelerate.integrations.accelerate import ODCPlugin, enable, get_engine

    enable()  # before the Accelerator: FSDP2 on CPU, engine attach, teardown (ODCPlugin would call it too)
    counts = [int(c) for c in args.counts.split(",")]
    vocab = 128
    if args.single:
        accelerator = Accelerator(cpu=True)
    elif args.plugin == "odc":
        kw = {"transport": args.transport} if args.transport else {}
        accelerator = Accelerator(fsdp_plugin=ODCPlugin(**kw))
    elif args.plugin == "fsdp2":
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    else:  # whatever the launch environment asks for (odc-accelerate launch / accelerate launch config)
        accelerator = Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    set_seed(0)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    engine = get_engine(accelerator)

    import contextlib

    if args.count_collectives:
        from tests.helpers.infra.dist_counter import count_dist_calls  # the jobs have the repository on PYTHONPATH
    else:
        count_dist_calls = contextlib.nullcontext
    losses, collectives = [], []
    for step in range(args.steps):
        batches = _batches(step, sum(counts), args.seq, vocab)
        mine = batches if args.single else batches[sum(counts[:rank]) : sum(counts[: rank + 1])]
        n_global = sum(int(b[:, 1:].numel()) for b in batches)
        scale = loss_scale(n_global, 1 if args.single else world)
        step_loss = 0.0
        with count_dist_calls() as in_microbatches:
            for ids in mine:
                logits = model(input_ids=ids).logits.float()
                nll = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="sum"
                )
                accelerator.backward(nll * scale)
                step_loss += float(nll.detach()) / n_global
        with count_dist_calls() as at_sync:
            if engine is not None:
                engine.pre_optimizer_step()
        if args.count_collectives:
            collectives.append({"microbatches": dict(in_microbatches), "pre_optimizer_step": dict(at_sync)})
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if engine is not None:
            engine.post_optimizer_step()
        losses.append(step_loss)

    params = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        params[name] = full.detach().float().flatten().tolist()
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    info = {
        "rank": rank,
        "world": world,
        "distributed_type": str(accelerator.distributed_type),
        "device": str(accelerator.device),
        "plugin": type(plugin).__name__ if plugin is not None else None,
        "fsdp_version": getattr(plugin, "fsdp_version", None),
        "engine": type(engine).__name__ if engine is not None else None,
        "transport": type(engine.transport).__name__ if engine is not None else None,
        "replicas": getattr(engine, "replicas", None),
        "replicate_buckets": getattr(engine, "replicate_buckets", None),
        "mesh": list(accelerator.torch_device_mesh.mesh_dim_names or ()) if accelerator.torch_device_mesh else None,
        "collectives": collectives,
        "losses": losses,
        "params": params,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"result_rank{rank}.json"), "w") as f:
        json.dump(info, f)
    if args.thread_report:
        _KEPT.append(model)
        report["before_end_training"] = _thread_names()
        report["rank"] = rank
    accelerator.end_training()


def _write_thread_report(out: str, report: dict) -> None:
    if "rank" not in report:  # the run failed before end_training: its own error says why
        return
    report["at_exit"] = _thread_names()
    with open(os.path.join(out, f"threads_rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
