"""`LengthBalancedBatchSampler`: deterministic, communication-free step plans from the step planner.

Every rank shuffles the dataset with the same seed, cuts the epoch into optimizer steps of ``samples_per_step``
samples (global, across all ranks), plans each step with `plan_from_costs` and yields its own row of the plan. No
rank ever talks to another: identical inputs give identical plans.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from .._compat import datasets as dcompat
from .._compat.datasets import arrow_column
from ..validation import check_positive_int
from .cost import CostSpec, QuadraticCost, check_costs, resolve_cost
from .dynamic import claim_queue
from .padded import plan_padded
from .plan import Plan, PlanName, as_lengths, check_oversize, normalize_plan, plan_from_costs, sample_parts

__all__ = ["LengthBalancedBatchSampler", "dataset_lengths"]

# In-memory cache of lengths computed from `datasets.Dataset`s, keyed by (fingerprint, rows, how). Computing
# lengths walks the whole dataset; samplers are rebuilt for every dataloader, so keep the last few results.
_LENGTH_CACHE: OrderedDict[tuple, np.ndarray] = OrderedDict()
_LENGTH_CACHE_SIZE = 8


def dataset_lengths(
    dataset: Any,
    length_column: str | None = None,
    length_fn: Callable[[Any], int] | None = None,
) -> np.ndarray:
    """Token count of every row of a dataset, computed once and cached in memory for `datasets.Dataset`.

    Args:
        dataset (`datasets.Dataset` or map-style dataset):
            The training dataset.
        length_column (`str`, *optional*):
            Column holding the length (integers), or a list column (e.g. ``"input_ids"``) whose per-row list length
            is the length.
        length_fn (`Callable[[dict], int]`, *optional*):
            Computes the length of one row. Used when no column fits; called once per row.

    Without either, uses the ``"length"`` column if present, else the length of ``"input_ids"``.
    """
    if length_column is not None and length_fn is not None:
        raise ValueError("Pass either `length_column` or `length_fn`, not both.")
    rows = len(dataset)
    if rows == 0:
        raise ValueError("The dataset is empty: there is nothing to sample. Check the dataset split and filters.")
    columns = list(getattr(dataset, "column_names", None) or [])
    if length_column is None and length_fn is None:
        if "length" in columns:
            length_column = "length"
        elif "input_ids" in columns:
            length_column = "input_ids"
        else:
            raise ValueError(
                "Cannot tell the length of a sample: pass `length_column=` (a column of lengths or of token ids) or "
                f"`length_fn=` (row -> length). Columns: {columns or 'unknown'}."
            )
    fingerprint = dcompat.fingerprint(dataset)
    how = ("column", length_column) if length_column is not None else ("fn", length_fn)
    key = (fingerprint, rows, how) if fingerprint is not None else None
    if key is not None and key in _LENGTH_CACHE:
        _LENGTH_CACHE.move_to_end(key)
        return _LENGTH_CACHE[key]

    if length_column is not None:
        lengths = _column_lengths(dataset, length_column, columns)
    else:
        lengths = np.fromiter((int(length_fn(dataset[i])) for i in range(rows)), dtype=np.int64, count=rows)
    lengths = as_lengths(lengths)
    if lengths.size != rows:
        raise ValueError(f"Computed {lengths.size} lengths for a dataset of {rows} rows.")
    lengths.setflags(write=False)
    if key is not None:
        _LENGTH_CACHE[key] = lengths
        while len(_LENGTH_CACHE) > _LENGTH_CACHE_SIZE:
            _LENGTH_CACHE.popitem(last=False)
    return lengths


def _column_lengths(dataset: Any, column: str, columns: list[str]) -> np.ndarray:
    if columns and column not in columns:
        raise ValueError(f"Column {column!r} is not in the dataset; columns are {columns}. Pass `length_column=`.")
    arrow = arrow_column(dataset, column)
    if arrow is not None:
        import pyarrow as pa
        import pyarrow.compute as pc

        if (
            pa.types.is_list(arrow.type)
            or pa.types.is_large_list(arrow.type)
            or pa.types.is_fixed_size_list(arrow.type)
        ):
            arrow = pc.list_value_length(arrow)
        if not (pa.types.is_integer(arrow.type) or pa.types.is_floating(arrow.type)):
            raise ValueError(f"Column {column!r} has type {arrow.type}; it must hold lengths or lists of tokens.")
        if arrow.null_count:
            raise ValueError(f"Column {column!r} has {arrow.null_count} missing value(s); every row needs a length.")
        return arrow.to_numpy()
    values = dataset[column] if columns else [dataset[i][column] for i in range(len(dataset))]
    return np.asarray([len(v) if hasattr(v, "__len__") else int(v) for v in values], dtype=np.int64)


class LengthBalancedBatchSampler(Sampler[list[list[int]]]):
    """Yields, per optimizer step, this rank's list of microbatches (lists of dataset indices), balanced by cost.

    Each epoch the dataset order is a permutation drawn from ``(seed, epoch)`` (numpy's PCG64). Consecutive chunks of
    ``samples_per_step`` samples form the optimizer steps; each step is planned with
    `odc_accelerate.planning.plan_step` (``plan="free"``: balanced per-rank totals, any microbatch count per rank;
    ``plan="lockstep"``: same microbatch count on every rank, every slot balanced) and this rank's part is yielded.
    With ``plan="dynamic"`` every rank yields the step's whole queue of microbatches (`claim_queue`), from which the
    ranks claim while the step runs. Every rank computes the same plan with no communication, runs the same number of steps, and every sample is used
    exactly once per epoch.

    Last step: with ``drop_last=True`` the final ``len(lengths) % samples_per_step`` samples are left out of the
    epoch (they are used in other epochs, as the permutation changes). With ``drop_last=False`` they form a smaller
    last step, planned like the others and never padded with repeated samples; when it has fewer samples than
    ranks, some ranks get no microbatch with the ``"free"`` plan (an empty list) or empty microbatches with the
    ``"lockstep"`` plan (empty lists in their slots).

    Resuming: `state_dict` records the epoch, the steps already yielded in it and the seed; after `load_state_dict`
    the next iteration continues with exactly the step an uninterrupted run would have yielded. The count is of
    steps handed out by the iterator: when a `DataLoader` prefetches, save the number of steps actually trained
    instead (``{"steps_consumed": n}``) and do not also skip batches with accelerate's ``skip_first_batches``.
    The world size may change between saving and loading: the remaining samples of the epoch are still each
    used once.

    Args:
        lengths (`Sequence[int]`, `np.ndarray` or 2-D array of shape ``(rows, k)``):
            Token count of every dataset row (see `from_dataset` to compute them from a `datasets.Dataset`). A row made
            of ``k`` sequences that always travel together (a DPO pair: chosen and rejected) is given as ``k``
            lengths: its tokens are their sum and its cost the sum of their costs, since each sequence is its own
            row of the batch (attention does not span them); with ``padded=True``, ``k`` rows as wide as the longest.
        world_size (`int`):
            Number of data-parallel ranks.
        rank (`int`):
            This process's rank, in ``[0, world_size)``.
        samples_per_step (`int`):
            Samples per optimizer step over ALL ranks (at least ``world_size``).
        max_tokens_per_microbatch (`int`, *optional*, defaults to 8192):
            Token budget of one microbatch.
        cost (`"auto"`, `"tokens"`, `QuadraticCost` or callable, *optional*, defaults to `"auto"`):
            Sample cost as a function of length, see `odc_accelerate.planning.resolve_cost`.
        plan (`PlanName` or `str`: `"free"`, `"lockstep"` or `"dynamic"`, *optional*, defaults to `"free"`):
            How each step is planned, see `odc_accelerate.planning.plan_step`.
        shuffle (`bool`, *optional*, defaults to `True`):
            Draw a new order every epoch; otherwise steps follow the dataset order.
        seed (`int`, *optional*, defaults to 0):
            Seed of the permutation; must be the same on every rank.
        drop_last (`bool`, *optional*, defaults to `True`):
            Drop the final incomplete step (see above).
        model_config (`PretrainedConfig`, *optional*):
            Model configuration for ``cost="auto"``.
        allow_oversize (`bool`, *optional*, defaults to `True`):
            With `False`, a dataset row longer than the budget raises a `ValueError` at construction.
        padded (`bool`, *optional*, defaults to `False`):
            Whether the collator pads every row of a microbatch to its longest sequence: microbatches are then
            planned on their padded shapes (`odc_accelerate.planning.plan_padded`; docs/planning.md, "Padded shapes").
        mode (`str`, *optional*):
            Deprecated spelling of ``plan``.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        world_size: int,
        rank: int,
        samples_per_step: int,
        max_tokens_per_microbatch: int = 8192,
        cost: CostSpec | QuadraticCost = "auto",
        plan: PlanName | str = PlanName.FREE,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        *,
        model_config: Any = None,
        allow_oversize: bool = True,
        padded: bool = False,
        mode: str | None = None,
    ):
        parts, lengths = sample_parts(lengths)
        if lengths.size == 0:
            raise ValueError("The dataset is empty (no lengths): there is nothing to sample.")
        world_size = check_positive_int(world_size, "`world_size`")
        max_tokens_per_microbatch = check_positive_int(
            max_tokens_per_microbatch,
            "`max_tokens_per_microbatch` (the most tokens one forward/backward can hold in memory)",
        )
        plan = normalize_plan(plan, mode=mode)
        if isinstance(rank, bool) or int(rank) != rank or not 0 <= rank < world_size:
            raise ValueError(f"`rank` must be an integer in [0, world_size={world_size}), got {rank!r}.")
        samples_per_step = check_positive_int(samples_per_step, "`samples_per_step`")
        if samples_per_step < world_size:
            raise ValueError(
                f"samples_per_step={samples_per_step} is smaller than world_size={world_size}, so some ranks would "
                "get no sample in any step. It counts samples per optimizer step over all ranks: set it to at "
                "least world_size (e.g. per-device batch size x world size)."
            )
        if drop_last and samples_per_step > lengths.size:
            raise ValueError(
                f"samples_per_step={samples_per_step} is larger than the dataset ({lengths.size} samples), so "
                "drop_last=True leaves no step in an epoch. Lower samples_per_step or pass drop_last=False."
            )
        if isinstance(seed, bool) or int(seed) != seed or seed < 0:
            raise ValueError(f"`seed` must be a non-negative integer, got {seed!r}.")
        self.padded = bool(padded)
        # Padded collation: a row of k sequences is k batch rows, each as wide as the longest of them.
        self._widths = parts.max(axis=1) if self.padded else None
        self._rows = np.full(lengths.size, parts.shape[1], dtype=np.int64) if self.padded else None
        if not allow_oversize:
            check_oversize(lengths if not self.padded else self._rows * self._widths, max_tokens_per_microbatch)

        self.lengths = lengths
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.samples_per_step = int(samples_per_step)
        self.max_tokens_per_microbatch = int(max_tokens_per_microbatch)
        self.plan = plan
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        # Costs of the whole dataset, once: a user callable is then called once per distinct length.
        cost_fn = resolve_cost(cost, model_config)
        if self.padded:
            self._row_costs = check_costs(cost_fn(self._widths))
            self.costs = self._row_costs * self._rows
        else:
            per_sequence = cost_fn(parts.reshape(-1)).reshape(parts.shape)
            self.costs = check_costs(np.asarray(per_sequence, dtype=np.float64).sum(axis=1))
        self.costs.setflags(write=False)
        self.epoch = 0
        self._resume_step = 0  # where the next __iter__ starts within `epoch` (set by load_state_dict)
        self._steps_consumed = 0  # steps of `epoch` handed out so far
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def mode(self) -> PlanName:
        """Deprecated spelling of ``plan``."""
        warnings.warn(
            "LengthBalancedBatchSampler.mode is deprecated and will be removed in the next release; use .plan.",
            FutureWarning,
            stacklevel=2,
        )
        return self.plan

    @classmethod
    def from_dataset(
        cls,
        dataset: Any,
        world_size: int,
        rank: int,
        samples_per_step: int,
        *,
        lengths: Sequence[int] | np.ndarray | None = None,
        length_column: str | None = None,
        length_fn: Callable[[Any], int] | None = None,
        **kwargs: Any,
    ) -> LengthBalancedBatchSampler:
        """Build the sampler for a `datasets.Dataset` (or any sized, indexable dataset).

        Args:
            dataset (`datasets.Dataset` or map-style dataset):
                The training dataset.
            world_size (`int`): number of data-parallel ranks.
            rank (`int`): this process's rank.
            samples_per_step (`int`): samples per optimizer step over all ranks.
            lengths (`Sequence[int]`, *optional*):
                Precomputed lengths; must have one entry per row.
            length_column (`str`, *optional*):
                Column of lengths, or of token lists whose lengths are used (see `dataset_lengths`).
            length_fn (`Callable[[dict], int]`, *optional*):
                Row -> length, computed once and cached in memory by dataset fingerprint.
            kwargs:
                Other arguments of `LengthBalancedBatchSampler`.
        """
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ValueError(
                f"{type(dataset).__name__} has no length or no indexing: the sampler needs a map-style dataset "
                "(e.g. datasets.Dataset, not an IterableDataset)."
            )
        rows = len(dataset)
        if rows == 0:
            raise ValueError("The dataset is empty: there is nothing to sample. Check the dataset split and filters.")
        if lengths is not None:
            if length_column is not None or length_fn is not None:
                raise ValueError("Pass precomputed `lengths` or a way to compute them (`length_column`/`length_fn`).")
            lengths = np.asarray(lengths)
            if lengths.ndim != 2:
                lengths = as_lengths(lengths)
            if lengths.shape[0] != rows:
                raise ValueError(
                    f"`lengths` has {lengths.shape[0]} entries but the dataset has {rows} rows; recompute the lengths "
                    "for this dataset (e.g. after filtering or selecting rows)."
                )
        else:
            lengths = dataset_lengths(dataset, length_column=length_column, length_fn=length_fn)
        return cls(lengths, world_size, rank, samples_per_step, **kwargs)

    # ----------------------------------------------------------------------------------------------------------
    # Epoch bookkeeping
    # ----------------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Number of optimizer steps per epoch (the same on every rank)."""
        full, rest = divmod(self.lengths.size, self.samples_per_step)
        return full + (1 if rest and not self.drop_last else 0)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration uses (call before each epoch, like `DistributedSampler`).

        Calling it with the epoch restored by `load_state_dict` keeps the resume point.

        Args:
            epoch (`int`): the epoch number.
        """
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._resume_step = 0
            self._steps_consumed = 0

    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch: ``epoch``, ``steps_consumed`` (steps yielded in it) and ``seed``, plus the
        fields that must match on resume."""
        return {
            "epoch": self.epoch,
            "steps_consumed": self._steps_consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "samples_per_step": self.samples_per_step,
            "num_samples": int(self.lengths.size),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the next iteration starts at step ``steps_consumed`` of ``epoch`` with the saved seed.

        Args:
            state_dict (`dict`): as returned by `state_dict` (``seed``, ``shuffle``, ``samples_per_step`` and
                ``num_samples`` are optional; when present they are checked or restored).
        """
        for name, current in (("samples_per_step", self.samples_per_step), ("num_samples", int(self.lengths.size))):
            saved = state_dict.get(name, current)
            if saved != current:
                raise ValueError(
                    f"Cannot resume exactly: the checkpoint has {name}={saved} but this sampler has {current}. "
                    f"Build the sampler with the same dataset and samples_per_step as the run that saved it."
                )
        if "shuffle" in state_dict and bool(state_dict["shuffle"]) != self.shuffle:
            raise ValueError(f"Cannot resume exactly: the checkpoint has shuffle={state_dict['shuffle']}.")
        steps = int(state_dict.get("steps_consumed", 0))
        if not 0 <= steps <= len(self):
            raise ValueError(f"`steps_consumed`={steps} is outside [0, {len(self)}] for this sampler.")
        self.seed = int(state_dict.get("seed", self.seed))
        self.epoch = int(state_dict["epoch"])
        self._resume_step = steps
        self._steps_consumed = steps
        self._order_cache = None

    # ----------------------------------------------------------------------------------------------------------
    # Planning
    # ----------------------------------------------------------------------------------------------------------

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        n = self.lengths.size
        if self.shuffle:
            # An explicit bit generator (not default_rng) pins the stream to PCG64 for every rank.
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            order = rng.permutation(n)
        else:
            order = np.arange(n)
        self._order_cache = (epoch, order)
        return order

    def step_indices(self, step: int, epoch: int | None = None) -> np.ndarray:
        """Dataset indices of optimizer step ``step`` of ``epoch`` (default: the current epoch), over all ranks.

        Args:
            step (`int`): step within the epoch, in ``[0, len(self))``.
            epoch (`int`, *optional*): epoch; defaults to the current one.
        """
        if not 0 <= step < len(self):
            raise ValueError(f"`step` must be in [0, {len(self)}), got {step}.")
        order = self._order(self.epoch if epoch is None else int(epoch))
        return order[step * self.samples_per_step : (step + 1) * self.samples_per_step]

    def global_plan(self, step: int, epoch: int | None = None) -> Plan:
        """The plan of every rank for one step, in dataset indices (what rank r yields is ``global_plan(...)[r]``).

        Useful to know step-wide figures without communication, e.g. the number of label tokens over all ranks.

        Args:
            step (`int`): step within the epoch.
            epoch (`int`, *optional*): epoch; defaults to the current one.
        """
        idx = self.step_indices(step, epoch)
        plan = self._plan(idx)
        return [[[int(idx[j]) for j in mb] for mb in rank_plan] for rank_plan in plan]

    def _plan(self, idx: np.ndarray) -> Plan:
        """The step's plan in positions of ``idx``."""
        if self.padded:
            return plan_padded(
                self._rows[idx],
                self._widths[idx],
                self._row_costs[idx],
                self.world_size,
                self.max_tokens_per_microbatch,
                self.plan,
            )
        return plan_from_costs(
            self.costs[idx], self.lengths[idx], self.world_size, self.max_tokens_per_microbatch, self.plan
        )

    def __iter__(self) -> Iterator[list[list[int]]]:
        epoch = self.epoch
        start = self._resume_step
        self._resume_step = 0
        self._steps_consumed = start
        for step in range(start, len(self)):
            idx = self.step_indices(step, epoch)
            plan = self._plan(idx)
            # Counted before the hand-over: a state_dict taken while this step trains already includes it.
            self._steps_consumed = step + 1
            mine = claim_queue(plan) if self.plan == PlanName.DYNAMIC else plan[self.rank]
            yield [[int(idx[j]) for j in mb] for mb in mine]
