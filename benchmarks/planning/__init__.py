"""Planning benchmark: the step planner against random sampling, BatchRebalanceSampler and plain LPT.

``python -m benchmarks.planning`` prints the tables; `metrics` holds the figures only the benchmark and the tests use
(`metrics.lower_bound`, `metrics.step_metrics`), `distributions` the token-length distributions, `arms` the plans the
planner is compared with.
"""
