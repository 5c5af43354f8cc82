"""``python -m benchmarks.e2e sft`` (and ``dpo``, ``reward``, ``kto``, ``sft_hsdp``): the real training example, end to
end, arm against arm.

``reward`` trains the reward-model example (``examples/reward/train.py``) on the long-tailed offline preference pairs,
written once per benchmark run with a ``length`` column (`benchmarks.e2e.data.reward_pairs`) so that transformers'
``BatchRebalanceSampler`` can read their lengths; its arms are ``fsdp2_random``, ``fsdp2_rebalance`` and ``odc``.

``kto`` trains the KTO example (``examples/kto/train.py``) on the same offline pairs, which TRL unpairs (chosen
desirable, rejected undesirable), 2 examples per microbatch (TRL's KL estimate needs 2 or more); its FSDP2 baseline is
TRL's KTO sampler, ``fsdp2_sequential`` (TRL refuses the others with a KL estimate), beside ``fsdp2_lockstep``, ``odc``
and the limit.

``sft_hsdp`` runs the same arms on a 2-D mesh, 2 replicas x 2 shards (4 processes, ``fsdp2_hsdp_cpu.yaml`` /
``odc_hsdp_cpu.yaml``): FSDP2's HSDP against ODC within each shard group with one all-reduce across replicas per step.

Each arm runs the example script (``examples/sft/train.py``, ``examples/dpo/train.py``) unchanged with ``accelerate
launch`` on 2 CPU processes (one thread each), on the same model, data and samples per optimizer step; only the way
the step is split over ranks and the communication change:

* ``fsdp2_random``: plain FSDP2, the Trainer's default random sampling (``per_device_train_batch_size`` samples per
  microbatch, ``gradient_accumulation_steps`` microbatches per rank and step);
* ``fsdp2_sequential`` (KTO): plain FSDP2 with ``--train_sampling_strategy sequential``, TRL's KTO default;
* ``fsdp2_rebalance``: plain FSDP2 with transformers' ``BatchRebalanceSampler``
  (``--train_sampling_strategy batch_rebalance``);
* ``fsdp2_lockstep``: plain FSDP2 on this package's ``lockstep`` plan (``--odc_plan lockstep``: equal microbatch
  counts, each slot balanced over ranks);
* ``fsdp2_rebalance_keep``: ``fsdp2_rebalance`` with ``--fsdp_reshard_after_forward false`` (parameters gathered
  once per microbatch instead of twice): what FSDP2 under the Trainer can keep; its gradients stay unsharded until a
  rank's last microbatch anyway (the Trainer's ``no_sync``);
* ``odc``: FSDP2 + ODC on this package's ``free`` plan (``--odc true``: each rank's total balanced, one sync per step),
  with the default step memory policy (``neither``: a gather per use, a scatter-add per microbatch);
* ``odc_grads`` / ``odc_both``: ``odc`` with ``--odc_memory_policy grads`` (unsharded gradients kept until the step
  boundary, as the Trainer accumulates) / ``both`` (also parameters gathered once per step);
* ``odc_packed`` (DPO): ``odc`` with ``--padding_free true``: each microbatch's pairs packed into one row, chosen and
  rejected each its own sequence (TRL 1.16 pads every pair), against the padded arms;
* ``limit``: the physical limit, mean per-rank compute with zero communication, MEASURED: W independent single
  processes (no process group, no FSDP) run at the same time, each the whole global step of the ``free`` plan's
  sampler (same samples per step); a rank's share is the step time / W. Running W of them at once keeps the machine
  as loaded as a W-rank job.

The planned arms pack several samples into one microbatch; on SFT they collate padding-free (``--padding_free
true``: one packed row, no padding computed), while the random / batch_rebalance arms run one sample per microbatch
(unpadded either way). TRL 1.16 has no padding-free DPO: its DPO microbatches, and those of the DPO arms but
``odc_packed``, are padded. The table's ``padding %`` is the share of the tokens the model computed that were padding
(every microbatch's ``rows x width`` against its real tokens, from the step traces).

Every process records its steps' microbatch shapes (``ODC_TRACE_DIR``, `odc_accelerate.telemetry.StepTrace`); they are
kept in ``results.json`` for ``python -m benchmarks.sim validate-e2e``.

Repeats are interleaved (every arm once, then every arm again, ...), so that machine noise hits all arms alike. With
``ODC_TIME_COLLECTIVES=1`` the trainer logs for every run, per optimizer step: step time, real (non-padding) tokens
of all ranks, per-rank busy (the rank's own forward and backward, less the time blocked in collectives inside them;
FSDP2's collectives are made synchronous to be timed, see `odc_accelerate.telemetry`), wait (the rest of the step) and
the bubble (docs/telemetry.md). Per run the first ``--warmup`` steps are
dropped; tokens/s = real tokens of the measured steps / their summed step time; the reported figure of an arm is the
median over repeats (per-rank peak RSS: the maximum). Speedups are ratios of tokens/s: arms with a different sampler
see different samples in a step, so equal tokens, not equal steps, are what compares.

Memory allocator: by default (``--allocator caching``) every arm runs with glibc set to keep freed blocks for reuse
(`benchmarks.e2e.environment`); ``--allocator system`` measures with glibc's defaults.

Writes ``OUT/results.json``, ``OUT/table.txt``, ``OUT/README_snippet.md``, ``OUT/e2e_<workload>.png`` (with
matplotlib) and every run's log and ``trainer_state.json`` under ``OUT/runs/``; ``OUT`` defaults to
``benchmarks/e2e/<workload>/``, where the stored results live. Figures are printed, never asserted.

Modules: `arms` (what runs), `environment` (the runs' environment and allocator), `runner` (launching runs),
`records` (parsing a run's logs), `aggregate` (statistics over repeats, targets), `report` (tables and files),
`plot`, and the command line (`cli`).
"""

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent
"""Stored results: ``RESULTS_DIR / <workload>`` (``results.json`` with step traces, table, snippet, PNG)."""
