"""``python -m benchmarks.grpo``: the GRPO example, end to end, FSDP2 as TRL runs it against ODC + plan.

Both arms run the example script (``examples/grpo/train.py``) unchanged with ``accelerate launch`` on 2 CPU
processes (one thread each), on the offline default: the tiny Qwen2 model generates every completion, and each
completion stops at its prompt's ``target_length`` (the token length of the passage's real continuation, at most
``--max_completion_length``), a long-tailed distribution. Same model, prompts, seed and completions per step:

* ``fsdp2``: plain FSDP2 as TRL runs GRPO (``examples/grpo/configs/fsdp2_cpu.yaml``): TRL's own microbatches
  (``per_device_train_batch_size`` completions each), generation with transformers' ``synced_gpus`` (every rank
  decodes until the longest completion of any rank is done);
* ``odc``: FSDP2 + ODC on this package's ``free`` plan (``examples/grpo/configs/odc_cpu.yaml``, ``--odc true
  --odc_plan free``): each rank stops generating at its own last token, and the step's completions are planned over
  the ranks so that each rank's training work is balanced;
* ``odc_vllm`` (only when asked for: ``--arms fsdp2,odc,odc_vllm``, run with the interpreter of
  ``scripts/vllm_env.sh``'s environment): ``odc`` with ``--use_vllm true --vllm_mode colocate``, each rank's own
  in-process vLLM engine refreshed from ODC's shards before each step's generation (the sync counts as generation
  time) and stopping each completion at the same target lengths (a per-prompt ``max_tokens``);
* ``fsdp2_vllm`` (likewise only when asked for): ``fsdp2`` with ``--use_vllm true --vllm_mode colocate``, TRL's own
  colocate mode: each rank's engine synced by TRL (every parameter gathered with FSDP2's collectives on every rank),
  the same per-prompt ``max_tokens``;
* ``rloo_fsdp2`` and ``rloo_odc`` (only when asked for: ``--arms rloo_fsdp2,rloo_odc``): ``fsdp2`` and ``odc`` for
  RLOO, TRL's RLOOTrainer on plain FSDP2 (ODC off, ``examples/rloo/configs/fsdp2_cpu.yaml``) and ODCRLOOTrainer on the
  free plan (``odc_cpu.yaml --odc true --odc_plan free``). RLOOTrainer takes no ``rollout_func``, so both run
  `benchmarks.grpo.rloo_train`: the offline RLOO script (``odc_accelerate.scripts.rloo``) whose trainer generates
  one turn with the GRPO arms' rollout (`odc_accelerate.demo.TargetLengthRollout`), the same in both arms: same
  prompts, same completion lengths as the GRPO arms. Their ratios are over ``rloo_fsdp2``. RLOO keeps TRL's default
  ``beta`` (0.05: a reference forward per step, in training time), GRPO TRL's 0.0.

The trainers (`odc_accelerate.integrations.trl.ODCGRPOTrainer`, ``ODCRLOOTrainer``) log, per optimizer step and for
every arm alike: step time, real tokens, per rank busy, wait and the wall time inside ``generate`` (part of busy), and
TRL's completion lengths. Per rank, training = busy - generation. Unlike `benchmarks.e2e`, FSDP2's collectives are not
timed (``--odc_time_collectives false``; they run asynchronously, as in production): generation is wall time, so busy
must be wall time too, and FSDP2's waits for peers inside ``generate`` and inside its microbatches count in its
generation and training time (with timed collectives they would leave busy but not generation). Per run
the first ``--warmup`` steps are dropped and the figures are means over the measured steps (a step's work depends on
its prompts' lengths; every arm draws the same prompts in the same order). The figure of an arm is the median over
repeats; the ratios ODC / FSDP2 (step time, generation time of the slowest rank, tokens/s) are taken within each
repeat, then their median. Repeats are interleaved and alternate the arms' order (FSDP2, ODC, then ODC, FSDP2, ...).

Writes ``OUT/results.json`` (with every run's per-step figures), ``OUT/table.txt``, ``OUT/README_snippet.md``,
``OUT/grpo.png`` (with matplotlib) and every run's log and ``trainer_state.json`` under ``OUT/runs/``; ``OUT``
defaults to ``benchmarks/grpo/``, where the stored results live. Figures are printed, never asserted.

Processes are launched by the end-to-end benchmark's runner (`benchmarks.e2e.runner`) in its environment
(`benchmarks.e2e.environment`). Modules: `arms` (what runs, default sizes), `rloo_train` (the RLOO arms' script),
`runner`, `records` (parsing a run's
log), `aggregate` (medians, ratios within repeats), `report` (tables and files), `plot`, and the command line
(`cli`).
"""

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent
"""Stored results: ``results.json``, ``table.txt``, ``README_snippet.md``, ``grpo.png``."""
