"""A/B of two commits on the engine benchmark: a subset of its arms, from whichever tree is first on ``PYTHONPATH``.

Kept outside both trees (the older one has no such driver) and run alternately from each, in one sitting::

    for i in 1 2 3 4; do
      for tree in NEW OLD; do  # each a checkout of one commit
        (cd $tree && PYTHONPATH=$tree:$THIS_FOLDER python $THIS_FOLDER/engine_ab.py OUT_$tree_$i.json \\
          fsdp,odc,odc_both,limit)
      done
    done

Each run: the benchmark's model and workloads, 2 warm-up and 8 measured steps per arm and workload, the arms
interleaved step by step; per arm and workload the median over steps of the slower rank's step time.
"""

import json
import statistics
import sys


def ab_worker(rank, world_size, cfg, opts, arms):
    import benchmarks.engine.workers as workers

    workers.ARMS = tuple(arms)  # the worker interleaves the arms it finds here
    return workers.timing_worker(rank, world_size, cfg, opts)


def main():
    out, arms = sys.argv[1], sys.argv[2].split(",")
    import odc_accelerate
    from odc_accelerate.testing import launch

    cfg = dict(vocab=2048, dim=256, heads=4, layers=8, mlp_ratio=4)
    opts = dict(warmup=2, steps=8, long=1024, short=256)
    res = launch(ab_worker, 2, cfg, opts, arms, timeout=3600, threads=1)
    med = {}
    for arm in arms:
        for workload in ("balanced", "imbalanced"):
            steps = [max(t) for t in zip(res[0]["times"][arm][workload], res[1]["times"][arm][workload], strict=True)]
            med[f"{arm}_{workload}_ms"] = statistics.median(steps) * 1e3
    med["odc_file"] = odc_accelerate.__file__  # which tree ran
    print(json.dumps(med, indent=1))
    with open(out, "w") as f:
        json.dump(med, f, indent=1)


if __name__ == "__main__":
    main()
