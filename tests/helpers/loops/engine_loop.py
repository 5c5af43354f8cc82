"""A custom training loop on `ODCEngine` alone, run as a plain ``torchrun`` script (CPU, gloo) by the tests.

The "Using the engine" loop of the README: a tiny Qwen3-MoE built from a config, ``fully_shard`` on every decoder
layer and on the root, an `ODCEngine`, a few optimizer steps (rank r runs ``counts[r]`` microbatches per step), then
``engine.close()`` and ``dist.destroy_process_group()``, the way a user's script ends. The model, optimizer and engine
stay referenced until the interpreter exits, as the globals of a script are.

Run with ``python -m torch.distributed.run --standalone --nproc_per_node 2 engine_loop.py``. With ``--out DIR``,
``threads_rank<r>.json`` in ``DIR`` lists this process's threads before the teardown and in the last exit handler;
``--keep-exit-handler=false`` removes the engine's exit handler (a control: gloo's workers are then left running);
``--destroy-first`` destroys the group before ``engine.close()``; ``--fsdp2-steps-after-close N`` trains N more steps
with FSDP2's own collectives after ``engine.close()`` (the group still exists).

``python -m tests.helpers.loops.engine_loop --repeat N --out DIR`` runs the job N times cheaply: each rank is a
process forked from this one after the imports (a fresh rank spends ~4 s of CPU importing torch and transformers, a
forked one under 1 s on the whole job), initialises the group from the environment as under ``torchrun`` and exits
through the normal interpreter shutdown, exit handlers included. ``DIR/repeat.json`` lists every run's exit codes,
whether its output says ``terminate called``, its wall and per-rank CPU seconds and the ranks' pids.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import sys
import time
import traceback

_KEPT: list = []  # objects that live until the interpreter exits, like a script's globals
_REPORT: dict = {}


def _thread_names() -> list[str]:
    """Names of this process's threads (Linux), e.g. gloo's ``pt_gloo_runloop`` workers."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended while listing
            pass
    return sorted(names)


def _write_thread_report(out: str) -> None:
    if "rank" not in _REPORT:  # the run failed before its teardown: its own error says why
        return
    _REPORT["at_exit"] = _thread_names()
    with open(os.path.join(out, f"threads_rank{_REPORT['rank']}.json"), "w") as f:
        json.dump(_REPORT, f)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="folder for threads_rank<r>.json")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--counts", default="1,2", help="microbatches per rank per step, comma-separated")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--keep-exit-handler", default="true", choices=["true", "false"])
    p.add_argument(
        "--fsdp2-steps-after-close",
        type=int,
        default=0,
        help="plain FSDP2 steps (one microbatch per rank) after engine.close(), before destroying the group",
    )
    p.add_argument("--destroy-first", action="store_true", help="destroy the process group before engine.close()")
    args = p.parse_args(argv)
    if args.out:
        # Registered before anything else, so it runs last of all exit handlers, just before the interpreter
        # finalises.
        atexit.register(_write_thread_report, args.out)

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from odc_accelerate import ODCEngine, loss_scale

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = [int(c) for c in args.counts.split(",")]
    if len(counts) != world:
        raise ValueError(f"--counts has {len(counts)} entries for {world} ranks")
    vocab = 128
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(cfg)
    # One mesh for every call: without it, each fully_shard builds its own default mesh (and, under a gloo default
    # group on a CUDA machine, its own process group).
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ODCEngine(model)
    if args.keep_exit_handler == "false":
        from odc_accelerate.engine import process_exit

        atexit.unregister(process_exit.release_process_groups_at_exit)

    def step(index: int, per_rank: list[int], odc: ODCEngine | None) -> None:
        g = torch.Generator().manual_seed(1000 + index)
        batches = [torch.randint(0, vocab, (1, args.seq), generator=g) for _ in range(sum(per_rank))]
        scale = loss_scale(sum(int(b[:, 1:].numel()) for b in batches), world)
        for ids in batches[sum(per_rank[:rank]) : sum(per_rank[: rank + 1])]:
            logits = model(input_ids=ids).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="sum"
            )
            (nll * scale).backward()
        if odc is not None:
            odc.pre_optimizer_step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if odc is not None:
            odc.post_optimizer_step()

    for index in range(args.steps):
        step(index, counts, engine)

    _KEPT.extend([model, optimizer, engine])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        _REPORT.update(rank=rank, before_teardown=_thread_names())
    if args.destroy_first:
        dist.destroy_process_group()
        engine.close()
    else:
        engine.close()
        for index in range(args.fsdp2_steps_after_close):  # FSDP2's own collectives again, lockstep
            step(args.steps + index, [1] * world, None)
        dist.destroy_process_group()


def repeat(
    runs: int, out: str, argv: list[str], world_size: int = 2, concurrency: int = 1, timeout: float = 120.0
) -> list[dict]:
    """Run the job ``runs`` times on ``world_size`` ranks forked from this process; see the module docstring.

    ``concurrency`` jobs run at once (a job waits on rendezvous and barriers part of the time). Each rank writes its
    stdout and stderr to ``out/run<i>_rank<r>.log``; ``--out out/run<i>`` is added to ``argv`` (thread reports). A job
    whose ranks overrun ``timeout`` seconds is killed and its missing exit codes are recorded as None.
    """
    import gc

    # Warm imports: everything a rank imports, so that a forked rank starts with it loaded.
    import torch.distributed.fsdp  # noqa: F401
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: F401

    import odc_accelerate.engine.engine  # noqa: F401
    from odc_accelerate.testing import free_port

    # The objects imported so far are left out of every garbage collection, the one at a rank's exit included: it
    # would walk all of torch and transformers in every rank (about half of a rank's CPU time).
    gc.freeze()
    os.makedirs(out, exist_ok=True)
    results: list[dict] = []
    pending, active = list(range(runs)), {}
    while pending or active:
        while pending and len(active) < concurrency:
            i, port = pending.pop(0), free_port()
            sys.stdout.flush()
            sys.stderr.flush()
            pids = []
            for rank in range(world_size):
                pid = os.fork()
                if pid == 0:
                    _run_forked_rank(i, rank, world_size, port, out, argv)  # never returns
                pids.append(pid)
            active[i] = {
                "pids": pids,
                "codes": [None] * world_size,
                "cpu_s": [0.0] * world_size,
                "start": time.monotonic(),
            }
        time.sleep(0.02)
        for i, job in list(active.items()):
            for r, pid in enumerate(job["pids"]):
                if job["codes"][r] is None:
                    done, status, usage = os.wait4(pid, os.WNOHANG)
                    if done:
                        job["codes"][r] = os.waitstatus_to_exitcode(status)
                        job["cpu_s"][r] = round(usage.ru_utime + usage.ru_stime, 2)
            overrun = time.monotonic() > job["start"] + timeout
            if None in job["codes"] and not overrun:
                continue
            for r, pid in enumerate(job["pids"]):
                if job["codes"][r] is None:  # nothing hangs: a stuck job is killed and reported
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
            del active[i]
            logs = []
            for r in range(world_size):
                with open(os.path.join(out, f"run{i}_rank{r}.log"), errors="replace") as f:
                    logs.append(f.read())
            results.append(
                {
                    "run": i,
                    "exit_codes": job["codes"],
                    "terminate_called": ["terminate called" in text for text in logs],
                    "wall_s": round(time.monotonic() - job["start"], 2),
                    "cpu_s": job["cpu_s"],
                    "pids": job["pids"],
                }
            )
    results.sort(key=lambda r: r["run"])
    with open(os.path.join(out, "repeat.json"), "w") as f:
        json.dump(results, f)
    return results


def _run_forked_rank(run: int, rank: int, world_size: int, port: int, out: str, argv: list[str]) -> None:
    """Body of a forked rank: the job, then the normal interpreter exit (``sys.exit`` unwinds to the top)."""
    code = 1
    try:
        fd = os.open(os.path.join(out, f"run{run}_rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        main([*argv, "--out", os.path.join(out, f"run{run}")])
        code = 0
    except BaseException:
        traceback.print_exc()
    sys.exit(code)


if __name__ == "__main__":
    if "--repeat" in sys.argv:
        rp = argparse.ArgumentParser()
        rp.add_argument("--repeat", type=int, required=True)
        rp.add_argument("--out", required=True)
        rp.add_argument("--concurrency", type=int, default=1)
        rp.add_argument("--timeout", type=float, default=120.0)
        known, rest = rp.parse_known_args()
        repeat(known.repeat, known.out, rest, concurrency=known.concurrency, timeout=known.timeout)
    else:
        main()
