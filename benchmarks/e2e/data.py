"""Training data the end-to-end benchmark writes for a workload before its runs (`Workload.data`)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["DATASETS", "reward_pairs"]


def reward_pairs(folder: Path) -> Path:
    """The offline preference pairs (`odc_accelerate.demo.offline_dpo_dataset`: long-tailed, a few dozen to over a
    thousand tokens) as JSON lines in ``folder``, each with a ``length`` column: the tokens of its longer side (prompt +
    completion + the EOS TRL appends), as TRL's collator pads both rows of a pair.

    transformers' ``BatchRebalanceSampler`` reads lengths from a ``length`` (or ``input_ids``) column, which TRL's
    tokenized reward data lacks (``chosen_ids`` / ``rejected_ids``); with this column, and ``--remove_unused_columns
    false`` so that the Trainer keeps it, the ``fsdp2_rebalance`` arm runs on the same data as the others (TRL's
    collator reads only the token ids). Returns ``folder``.
    """
    from odc_accelerate.demo import load_offline_tokenizer, offline_dpo_dataset

    tokenizer = load_offline_tokenizer()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w", encoding="utf-8") as f:
        for row in offline_dpo_dataset():
            sides = (row["prompt"] + row["chosen"], row["prompt"] + row["rejected"])
            length = max(len(tokenizer(text)["input_ids"]) + 1 for text in sides)
            f.write(json.dumps({**row, "length": length}) + "\n")
    return folder


#: `Workload.data` name -> the function that writes the data into a folder and returns it.
DATASETS = {"reward_pairs": reward_pairs}
