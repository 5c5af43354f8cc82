"""What the GRPO benchmark runs: the examples, their default sizes, and the arms (GRPO's, and RLOO's on the same
completion lengths)."""

from __future__ import annotations

from benchmarks.e2e.arms import Arm

SCRIPT = "examples/grpo/train.py"
CONFIGS = "examples/grpo/configs"
RLOO_SCRIPT = "benchmarks/grpo/rloo_train.py"
"""The RLOO arms' script: the offline RLOO script with the GRPO arms' target-length rollout
(`benchmarks.grpo.rloo_train`)."""
RLOO_CONFIGS = "examples/rloo/configs"

ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        # TRL's own GRPO step on FSDP2: its microbatches, generation with transformers' synced_gpus
        Arm("fsdp2", "FSDP2 (TRL)", "fsdp2_cpu.yaml"),
        # the completions of the step planned over ranks; generation without peer sync
        Arm("odc", "ODC + plan free", "odc_cpu.yaml", ("--odc", "true", "--odc_plan", "free"), planned=True),
        # TRL's own GRPO with vLLM colocate on FSDP2: each rank's engine, synced by TRL (full parameters gathered with
        # collectives on every rank); needs vLLM, so it runs only when asked for
        Arm("fsdp2_vllm", "FSDP2 (TRL) + vLLM", "fsdp2_cpu.yaml", ("--use_vllm", "true", "--vllm_mode", "colocate")),
        # as odc, with each rank's own in-process vLLM engine generating (synced from ODC's shards, no collective);
        # needs vLLM (the environment of scripts/vllm_env.sh), so it runs only when asked for
        Arm(
            "odc_vllm",
            "ODC + plan free + vLLM",
            "odc_cpu.yaml",
            ("--odc", "true", "--odc_plan", "free", "--use_vllm", "true", "--vllm_mode", "colocate"),
            planned=True,
        ),
        # RLOO on the GRPO arms' prompts and completion lengths (one script for both, benchmarks/grpo/rloo_train.py):
        # TRL's RLOOTrainer on plain FSDP2 (ODC off: its microbatches, generation with synced_gpus) ...
        Arm("rloo_fsdp2", "RLOO: FSDP2 (TRL)", "fsdp2_cpu.yaml"),
        # ... and ODCRLOOTrainer on the free plan
        Arm(
            "rloo_odc", "RLOO: ODC + plan free", "odc_cpu.yaml", ("--odc", "true", "--odc_plan", "free"), planned=True
        ),
    )
}
DEFAULT_ARMS = ("fsdp2", "odc")
"""The arms run when ``--arms`` is not given (the vLLM arm needs vLLM installed)."""

VLLM_ARMS = {"fsdp2_vllm", "odc_vllm"}
"""Arms that generate with vLLM."""

RLOO_ARMS = {"rloo_fsdp2", "rloo_odc"}
"""Arms that train with RLOO (`RLOO_SCRIPT`, `RLOO_CONFIGS`); the others train with GRPO."""

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "ODC_BENCH_VLLM_TORCH_LINEAR": "1"}
"""Environment of the vLLM arms' processes: 1 GiB of KV cache per engine on CPU (vLLM's CPU backend sizes its cache
from this, not from ``--vllm_gpu_memory_utilization``), vLLM's warnings only, and linear layers computed with
``torch.nn.functional.linear`` in every vLLM arm alike: vLLM's CPU GEMM dispatch (oneDNN, SGL) drops the weights that
TRL's own colocate sync (``fsdp2_vllm``) loads into (`tests.helpers.loops.run_example.torch_linear_vllm`)."""
BASELINE = "fsdp2"
"""The arm the GRPO arms' ratios are taken against (ODC / FSDP2)."""
RLOO_BASELINE = "rloo_fsdp2"
"""The arm the RLOO arms' ratios are taken against (RLOO's ODC / RLOO's FSDP2)."""


def baseline_of(name: str) -> str:
    """The arm whose figures ``name``'s ratios divide by: FSDP2 as TRL runs the same trainer."""
    return RLOO_BASELINE if name in RLOO_ARMS else BASELINE


def script_of(name: str) -> str:
    """The script arm ``name`` runs, relative to the repository root."""
    return RLOO_SCRIPT if name in RLOO_ARMS else SCRIPT


def configs_of(name: str) -> str:
    """The folder of arm ``name``'s accelerate config (``ARMS[name].config``), relative to the repository root."""
    return RLOO_CONFIGS if name in RLOO_ARMS else CONFIGS


DEFAULTS = dict(
    batch=4,
    grad_accum=1,
    num_generations=4,
    max_completion_length=256,
    max_steps=4,
    warmup=1,
    seed=42,
)
"""Sizes of the full run (sized for both arms x 3 repeats in about 10 minutes on 2 quiet cores): each optimizer step
generates ``batch x grad_accum`` completions per rank, i.e. one group of ``num_generations`` completions of one
prompt per rank; a group's completions all stop at their prompt's ``target_length`` (capped at
``max_completion_length``), so ranks get very different lengths from step to step."""

REPLACED = {"max_completion_length": 512, "num_generations": 8, "per_device_train_batch_size": 8}
"""Values (TRL's defaults) that the offline example silently replaces by its own CPU defaults: refused."""
