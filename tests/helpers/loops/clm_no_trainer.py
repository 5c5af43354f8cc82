"""A training loop shaped as transformers' ``run_clm_no_trainer.py``: a plain ``Accelerator()``, nothing of ODC.

``accelerator.prepare``, ``with accelerator.accumulate(model):``, ``accelerator.backward(loss)``, ``if
accelerator.sync_gradients: accelerator.clip_grad_norm_(...)``, ``optimizer.step()``, ``lr_scheduler.step()``,
``optimizer.zero_grad()``, on a tiny Qwen2 and fixed token ids (a per-batch mean loss, as the script's). The tests run
it unmodified under ``odc-accelerate launch`` with ODC on and off. Each rank writes ``result_rank<r>.json`` into
``--out``: how the run was set up, the token ids and loss of every microbatch it ran per optimizer step, the initial and
final parameters (full tensors) and the size of its local shards.

``--replay DIR`` (one plain process) trains a fresh copy of the same model on the microbatches the ranks of the run in
``DIR`` recorded, step by step, with the gradient that run should have: the sum over ranks and microbatches of
``loss / gradient_accumulation_steps``, divided by the number of ranks (FSDP2's average). It writes
``result_replay.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import torch

VOCAB, SEQ = 128, 16


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(cfg)


def _optimizer(model, lr: float):
    # run_clm_no_trainer's two groups: no weight decay for biases and norms
    no_decay = ["bias", "norm.weight"]
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": 0.01,
        },
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr)


def _full_params(model) -> dict[str, list[float]]:
    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.detach().float().flatten().tolist()
    return out


class _Samples(torch.utils.data.Dataset):
    """Fixed random token ids (seeded); ``labels`` are the inputs, as run_clm's grouped texts."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(args: argparse.Namespace) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin
    from transformers import default_data_collator, get_scheduler

    accelerator = Accelerator(
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_each_batch=args.sync_each_batch
        ),
        dataloader_config=DataLoaderConfiguration(even_batches=not args.uneven),
    )
    model = _model()
    initial = _full_params(model)
    loader = torch.utils.data.DataLoader(
        _Samples(args.samples), batch_size=args.per_device_train_batch_size, collate_fn=default_data_collator
    )
    optimizer = _optimizer(model, args.learning_rate)
    scheduler = get_scheduler("constant", optimizer=optimizer)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    steps: list[list[dict]] = [[]]
    completed = 0
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            steps[-1].append({"input_ids": batch["input_ids"].tolist(), "loss": float(loss.detach())})
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed += 1
            if completed >= args.max_train_steps:
                break
            steps.append([])
    steps = [s for s in steps if s]

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    info = {
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "plugin": type(plugin).__name__ if plugin is not None else None,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "steps": steps,
        "optimizer_steps": completed,
        "local_numel": local,
        "numel": sum(len(v) for v in initial.values()),
        "initial": initial,
        "params": _full_params(model),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"result_rank{accelerator.process_index}.json"), "w") as f:
        json.dump(info, f)
    accelerator.end_training()


def replay(args: argparse.Namespace) -> None:
    ranks = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(args.replay, "result_rank*.json")))]
    world, ga = len(ranks), ranks[0]["gradient_accumulation_steps"]
    model = _model()
    initial = _full_params(model)
    optimizer = _optimizer(model, args.learning_rate)
    losses = []
    for step in range(max(len(r["steps"]) for r in ranks)):
        step_losses = []
        for r in ranks:
            for mb in r["steps"][step] if step < len(r["steps"]) else []:
                ids = torch.tensor(mb["input_ids"])
                loss = model(input_ids=ids, labels=ids).loss
                step_losses.append(float(loss.detach()))
                (loss / ga / world).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_losses)
    with open(os.path.join(args.out, "result_replay.json"), "w") as f:
        json.dump({"losses": losses, "initial": initial, "params": _full_params(model)}, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--replay", default=None, help="a run's --out: train one process on its recorded microbatches")
    p.add_argument("--samples", type=int, default=24)
    p.add_argument("--per_device_train_batch_size", type=int, default=2)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--max_train_steps", type=int, default=3)
    p.add_argument("--learning_rate", type=float, default=5e-3)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--uneven", action="store_true", help="even_batches=False: the last step may differ per rank")
    p.add_argument("--sync_each_batch", action="store_true")
    args = p.parse_args()
    if args.replay:
        os.makedirs(args.out, exist_ok=True)
        replay(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
