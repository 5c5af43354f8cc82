"""Step-time simulator for FSDP2 (per-layer lockstep) and ODC (one sync per step) under different samplers.

Pure numpy, no torch: ``simulate(plan, lengths, model, hardware, system)`` predicts one optimizer step from

- the step plan (``plan[r][k]`` = indices of the samples in microbatch ``k`` of rank ``r``, as `plan_step` returns
  it) and the samples' token counts;
- a `ModelSpec` (layers, hidden, MLP width, heads, vocab): per-layer compute from the same FLOP count as
  `odc_accelerate.planning.flops_cost` (linear FLOPs per token + causal attention ``L^2`` term, forward + backward)
  and per-layer parameter bytes;
- a `Hardware` description: effective FLOP/s per device, devices per node, intra-/inter-node bandwidth and latency
  for collectives (FSDP2) and for one-sided reads / accumulates (ODC), and whether communication overlaps compute.

Model (every assumption the predictions rest on):

- FSDP2: every microbatch slot ``k`` runs every layer in lockstep on all ranks (a collective completes only when the
  last rank arrives), so a layer costs ``max_r compute[r, k, layer]``; forward needs one all-gather per layer,
  backward one all-gather and one reduce-scatter. With ``overlap=True`` the collective of the next layer runs during
  the current layer's compute (per-layer time ``max(compute, comm)``, plus the first, unhidden all-gather of each
  pass); without overlap the two add up. Ranks with fewer microbatches still join every collective (empty slot).
- ODC: a rank runs its own microbatches without waiting for anybody: per layer its compute and its one-sided reads
  of the ``(W-1)/W`` of the layer's parameters it does not own (forward and backward) and its accumulates of the
  ``(W-1)/W`` of its gradients owned by others (backward), overlapped or added as for FSDP2; ``contention`` (>= 1)
  stretches this traffic for owners that serve several readers at once. One barrier per step: the step costs the
  slowest rank plus the barrier.
- ODC, ordered reduction (``reduction="ordered"``): no accumulate in any backward (each rank adds its microbatches'
  gradients into its own buffers, a local add not charged); after the slowest rank and a barrier, each owner reads
  the ``(W-1)/W`` of every group's gradient that peers hold for it, at the one-sided read bandwidth, group after group
  with one latency each, not overlapped with anything; then a barrier before the buffers are zeroed. The owner's adds
  of what it read are not charged either.
- Collective cost (ring): ``(W-1)/W * bytes / bandwidth`` plus one latency per ring hop; across nodes the
  inter-node link is the bottleneck and the ring has one inter-node hop per node. One-sided traffic splits its
  volume between intra-node peers (NVLink-class link) and remote peers (network), which run in parallel.
- Not modelled: the optimizer step and gradient clipping (the same for every arm), memory limits, kernel efficiency
  differences between short and long sequences, stragglers, and the planner's own time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from odc_accelerate.planning import QuadraticCost, flops_cost

Plan = list[list[list[int]]]


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder-only transformer as the simulator sees it.

    Args:
        layers (`int`): decoder layers (each one FSDP2 param group, as accelerate / TRL wrap them).
        hidden (`int`): model width.
        intermediate (`int`): MLP width.
        heads (`int`): query heads.
        kv_heads (`int`, *optional*): key/value heads (GQA); defaults to ``heads``.
        vocab (`int`, *optional*, defaults to 0): vocabulary; embedding and LM head form the root param group.
        head_dim (`int`, *optional*): per-head width; defaults to ``hidden // heads``.
        gated_mlp (`bool`, *optional*, defaults to `True`): SwiGLU-style MLP (3 matrices) or plain (2).
        tied_embeddings (`bool`, *optional*, defaults to `False`): embedding and LM head share one matrix.
        param_bytes (`int`, *optional*, defaults to 2): bytes per gathered parameter (bf16 mixed precision).
        grad_bytes (`int`, *optional*, defaults to 4): bytes per reduced gradient element (fp32 reduce).
        seconds (`QuadraticCost`, *optional*): measured seconds of one sequence's forward + backward on one device
            (`benchmarks.calibration`); when set, compute time is this instead of FLOPs / ``Hardware.flops``, split
            over the param groups as the FLOP count splits it.
        fixed_s (`float`, *optional*, defaults to 0): measured fixed seconds per microbatch (the calibration's
            intercept), with ``seconds`` only.
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int | None = None
    vocab: int = 0
    head_dim: int | None = None
    gated_mlp: bool = True
    tied_embeddings: bool = False
    param_bytes: int = 2
    grad_bytes: int = 4
    seconds: QuadraticCost | None = None
    fixed_s: float = 0.0

    def __post_init__(self):
        for name in ("layers", "hidden", "intermediate", "heads"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelSpec needs a positive `{name}`, got {getattr(self, name)}.")

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention projections, MLP, two norms)."""
        hd = self.head_dim or self.hidden // self.heads
        d_q, d_kv = self.heads * hd, (self.kv_heads or self.heads) * hd
        attn = self.hidden * d_q + 2 * self.hidden * d_kv + d_q * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return attn + mlp + 2 * self.hidden

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embedding, LM head (unless tied), final norm."""
        return (1 if self.tied_embeddings else 2) * self.vocab * self.hidden + self.hidden

    @property
    def num_params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    def group_costs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per param group (root first, then the layers): FLOPs per token, FLOPs per squared token, parameters."""
        cost = flops_cost(
            num_layers=self.layers,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            vocab_size=self.vocab,
            head_dim=self.head_dim,
            gated_mlp=self.gated_mlp,
        )
        head = 3.0 * 2 * self.hidden * self.vocab  # forward + backward of the LM head, in the root group
        lin = np.array([head] + [(cost.linear - head) / self.layers] * self.layers)
        quad = np.array([0.0] + [cost.quadratic / self.layers] * self.layers)
        params = np.array([self.root_params] + [self.layer_params] * self.layers, dtype=np.float64)
        return lin, quad, params

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> ModelSpec:
        """Build from a transformers config (or a dict with its field names)."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        return cls(
            layers=int(get("num_hidden_layers")),
            hidden=int(get("hidden_size")),
            intermediate=int(get("intermediate_size")),
            heads=int(get("num_attention_heads")),
            kv_heads=get("num_key_value_heads"),
            vocab=int(get("vocab_size") or 0),
            head_dim=get("head_dim"),
            tied_embeddings=bool(get("tie_word_embeddings", False)),
            **kwargs,
        )


# Qwen2.5 configs (the numbers of the published config.json files).
QWEN2_5_1_5B = ModelSpec(layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, vocab=151936,
                         tied_embeddings=True)  # fmt: skip
QWEN2_5_7B = ModelSpec(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064)


@dataclass(frozen=True)
class Hardware:
    """Per-device hardware figures.

    Args:
        flops (`float`): effective training FLOP/s per device (peak x achieved MFU).
        gpus_per_node (`int`): devices per node (ranks ``0..g-1`` share a node, and so on).
        intra_bw (`float`): collective bandwidth per device inside a node, bytes/s (ring bus bandwidth).
        inter_bw (`float`): collective bandwidth per device across nodes, bytes/s.
        intra_lat (`float`): latency of one ring hop inside a node, seconds.
        inter_lat (`float`): latency of one inter-node ring hop, seconds.
        p2p_intra_bw (`float`, *optional*): one-sided read / accumulate bandwidth inside a node; defaults to
            ``intra_bw``.
        p2p_inter_bw (`float`, *optional*): one-sided bandwidth across nodes; defaults to ``inter_bw``.
        p2p_acc_intra_bw (`float`, *optional*): one-sided accumulate bandwidth inside a node, bytes of gradient
            source per second (an atomic add is slower than a read); defaults to ``p2p_intra_bw``.
        p2p_lat (`float`, *optional*): fixed cost of one one-sided gather or scatter-accumulate (all peers, issued
            together); defaults to ``inter_lat`` across nodes, ``intra_lat`` inside one.
        barrier_lat (`float`, *optional*, defaults to 0): one step barrier (ODC pays two per step).
        overlap (`bool`, *optional*, defaults to `True`): communication of the next layer runs during compute.
        contention (`float`, *optional*, defaults to 1): factor >= 1 on one-sided traffic time.
        fixed_per_group (`float`, *optional*, defaults to 0): per-group per-pass overhead paid by both FSDP2 and ODC
            (hook / copy-in / copy-out bookkeeping), seconds.
    """

    flops: float
    gpus_per_node: int
    intra_bw: float
    inter_bw: float
    intra_lat: float = 0.0
    inter_lat: float = 0.0
    p2p_intra_bw: float | None = None
    p2p_inter_bw: float | None = None
    p2p_acc_intra_bw: float | None = None
    p2p_lat: float | None = None
    barrier_lat: float = 0.0
    overlap: bool = True
    contention: float = 1.0
    fixed_per_group: float = 0.0

    def __post_init__(self):
        if not (self.flops > 0 and self.intra_bw > 0 and self.inter_bw > 0 and self.gpus_per_node >= 1):
            raise ValueError("Hardware needs positive flops, bandwidths and gpus_per_node.")
        if self.contention < 1:
            raise ValueError(f"`contention` must be >= 1, got {self.contention}.")

    def with_(self, **kwargs: Any) -> Hardware:
        return replace(self, **kwargs)


# H100 SXM figures (assumed, not measured): 989 TFLOP/s dense bf16 peak at 40% MFU; NVLink 4 ring bus bandwidth
# ~300 GB/s per GPU; one 400 Gb/s NDR InfiniBand NIC per GPU (~45 GB/s achieved); latencies per ring hop.
H100 = Hardware(
    flops=0.4 * 989e12,
    gpus_per_node=8,
    intra_bw=300e9,
    inter_bw=45e9,
    intra_lat=5e-6,
    inter_lat=10e-6,
    barrier_lat=50e-6,
)


def collective_time(nbytes: np.ndarray | float, world: int, hw: Hardware) -> np.ndarray | float:
    """Ring all-gather / reduce-scatter of ``nbytes`` (the full unsharded size) over ``world`` ranks."""
    if world <= 1:
        return np.zeros_like(np.asarray(nbytes, dtype=np.float64)) if np.ndim(nbytes) else 0.0
    vol = (world - 1) / world * np.asarray(nbytes, dtype=np.float64)
    g = min(hw.gpus_per_node, world)
    nodes = math.ceil(world / g)
    if nodes == 1:
        out = vol / hw.intra_bw + (world - 1) * hw.intra_lat
    else:
        # Every byte crosses the node boundary on a ring that spans nodes: the slower link sets the pace.
        out = vol / min(hw.inter_bw, hw.intra_bw) + (nodes - 1) * hw.inter_lat + (g - 1) * hw.intra_lat
    return out if np.ndim(nbytes) else float(out)


def one_sided_time(nbytes: np.ndarray | float, world: int, hw: Hardware) -> np.ndarray | float:
    """One-sided gather (or scatter-accumulate) of the ``(W-1)/W`` of ``nbytes`` that peers own."""
    if world <= 1:
        return np.zeros_like(np.asarray(nbytes, dtype=np.float64)) if np.ndim(nbytes) else 0.0
    b = np.asarray(nbytes, dtype=np.float64)
    g = min(hw.gpus_per_node, world)
    intra_bw = hw.p2p_intra_bw or hw.intra_bw
    inter_bw = hw.p2p_inter_bw or hw.inter_bw
    local = (g - 1) / world * b / intra_bw
    remote = (world - g) / world * b / inter_bw
    lat = hw.p2p_lat if hw.p2p_lat is not None else (hw.inter_lat if world > g else hw.intra_lat)
    out = hw.contention * np.maximum(local, remote) + lat  # the two links run in parallel
    return out if np.ndim(nbytes) else float(out)


def plan_arrays(plan: Plan, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens[r, k], squared[r, k], present[r, k])`` of a plan: token sum, sum of ``L^2``, microbatch exists."""
    lengths = np.asarray(lengths, dtype=np.float64)
    world = len(plan)
    slots = max((len(p) for p in plan), default=0)
    tok = np.zeros((world, max(slots, 1)))
    sq = np.zeros_like(tok)
    present = np.zeros(tok.shape, dtype=bool)
    for r, mbs in enumerate(plan):
        for k, mb in enumerate(mbs):
            present[r, k] = True
            if len(mb):
                ls = lengths[np.asarray(mb, dtype=np.int64)]
                tok[r, k] = ls.sum()
                sq[r, k] = (ls * ls).sum()
    return tok, sq, present


@dataclass
class StepResult:
    """One simulated step.

    Attributes:
        step_s (`float`): step time (seconds).
        busy_s (`np.ndarray`): per-rank compute time (seconds).
        wait_s (`np.ndarray`): per-rank time not spent computing: unhidden communication and waiting (seconds).
        tokens (`float`): real tokens of the step over all ranks.
        limit_s (`float`): mean per-rank compute with zero communication (the physical limit of the step).
        exchange_s (`float`): ODC's ordered reduction: the step-boundary exchange of gradients (0 otherwise).
    """

    step_s: float
    busy_s: np.ndarray
    wait_s: np.ndarray
    tokens: float
    limit_s: float
    exchange_s: float = 0.0

    @property
    def bubble_pct(self) -> float:
        """``100 * (1 - mean busy / step)``: share of the step a rank spends not computing."""
        return 100.0 * (1.0 - float(self.busy_s.mean()) / self.step_s) if self.step_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0


def _per_group_compute(tok: np.ndarray, sq: np.ndarray, model: ModelSpec, hw: Hardware) -> np.ndarray:
    """Compute seconds ``[group, r, k]`` (forward + backward) of every microbatch in every param group."""
    lin, quad, _ = model.group_costs()
    if model.seconds is not None:  # measured: the FLOP count only says how the time splits over the groups
        lin_s, quad_s = lin * (model.seconds.linear / lin.sum()), quad * (model.seconds.quadratic / quad.sum())
        fixed = np.full(lin.shape, model.fixed_s / lin.size)[:, None, None] * (tok > 0)[None]
        return lin_s[:, None, None] * tok[None] + quad_s[:, None, None] * sq[None] + fixed
    return (lin[:, None, None] * tok[None] + quad[:, None, None] * sq[None]) / hw.flops


def _pass_time(compute: np.ndarray, comm: np.ndarray, overlap: bool) -> np.ndarray:
    """Time of one pass over the groups: compute ``[G, ...]`` and comm ``[G]`` (per group) -> ``[...]``.

    With overlap the group's collective runs while the previous group computes, so each group costs
    ``max(compute, comm)`` plus the first group's communication, which nothing hides.
    """
    c = comm.reshape((-1,) + (1,) * (compute.ndim - 1))
    if overlap:
        return np.maximum(compute, c).sum(axis=0) + comm[0]
    return (compute + c).sum(axis=0)


def simulate(
    plan: Plan,
    lengths: np.ndarray,
    model: ModelSpec,
    hw: Hardware,
    system: str,
    *,
    accumulate_locally: bool = False,
    reference_forward: bool = False,
    reduction: str = "atomic",
) -> StepResult:
    """Predict one optimizer step of ``plan`` under ``system`` (``"fsdp2"`` or ``"odc"``).

    Args:
        plan (`list[list[list[int]]]`): ``plan[r][k]`` = sample indices of microbatch ``k`` of rank ``r``.
        lengths (`np.ndarray`): token count of every sample the plan indexes.
        model (`ModelSpec`): the model.
        hw (`Hardware`): the hardware.
        system (`str`): ``"fsdp2"`` (per-layer lockstep collectives) or ``"odc"`` (one-sided, one sync per step).
        accumulate_locally (`bool`, *optional*, defaults to `False`):
            Gradients stay local (unsharded) until a rank's last microbatch, whose backward alone reduce-scatters
            (FSDP2) or scatter-adds (ODC): the Trainer's gradient accumulation (``no_sync``). With `False` every
            microbatch's backward does (accelerate's ``sync_each_batch``, the ODC paper's setting).
        reference_forward (`bool`, *optional*, defaults to `False`):
            DPO: a frozen reference model of the same shape, sharded the same way, runs one more forward per
            microbatch (its own all-gathers or reads, no backward, no gradient).
        reduction (`str`, *optional*, defaults to `"atomic"`):
            ODC only. ``"atomic"``: gradients are added into their owners in the backward (every microbatch's, or the
            last one's with ``accumulate_locally``). ``"ordered"``: no backward adds into the owners; each owner reads
            its shard's contributions once per step, after the slowest rank, between two barriers
            (``accumulate_locally`` has no effect).
    """
    if system not in ("fsdp2", "odc"):
        raise ValueError(f"Unknown system {system!r}: use 'fsdp2' or 'odc'.")
    if reduction not in ("atomic", "ordered"):
        raise ValueError(f"Unknown reduction {reduction!r}: use 'atomic' or 'ordered'.")
    if reduction == "ordered" and system != "odc":
        raise ValueError("reduction='ordered' is ODC's: FSDP2 reduce-scatters its gradients.")
    world = len(plan)
    tok, sq, present = plan_arrays(plan, lengths)
    comp = _per_group_compute(tok, sq, model, hw)  # [G, W, K]
    _, _, params = model.group_costs()
    fwd, bwd = comp / 3.0, comp * (2.0 / 3.0)  # backward costs twice the forward for every matmul
    passes = 2 if reference_forward else 1  # forward passes per microbatch: the policy's (and the reference's)
    busy = comp.sum(axis=(0, 2)) + (passes - 1) * fwd.sum(axis=(0, 2))
    limit = float(busy.mean())
    fixed = hw.fixed_per_group
    if system == "fsdp2":
        ag = collective_time(params * model.param_bytes, world, hw) + fixed
        rs = collective_time(params * model.grad_bytes, world, hw) + fixed
        # Lockstep: inside slot k every group waits for the slowest rank. Slots missing on a rank still run
        # their collectives (FSDP2 requires the same number of microbatches everywhere), with no compute.
        slot_fwd = fwd.max(axis=1)  # [G, K]
        slot_bwd = bwd.max(axis=1)
        n_slots = tok.shape[1] if present.any() else 0
        bwd_t = _pass_time(slot_bwd, ag + rs, hw.overlap)
        if accumulate_locally:
            bwd_t = np.where(np.arange(bwd_t.size) == n_slots - 1, bwd_t, _pass_time(slot_bwd, ag, hw.overlap))
        per_slot = passes * _pass_time(slot_fwd, ag, hw.overlap) + bwd_t
        step = float(per_slot[:n_slots].sum())
        return StepResult(step, busy, step - busy, float(tok.sum()), limit)
    rd = one_sided_time(params * model.param_bytes, world, hw) + fixed
    acc_hw = hw if hw.p2p_acc_intra_bw is None else hw.with_(p2p_intra_bw=hw.p2p_acc_intra_bw)
    acc = one_sided_time(params * model.grad_bytes, world, acc_hw) + fixed
    if reduction == "ordered":
        per_mb = passes * _pass_time(fwd, rd, hw.overlap) + _pass_time(bwd, rd, hw.overlap)
        per_rank = np.where(present, per_mb, 0.0).sum(axis=1)
        # the exchange: every group's shard read from the peers at the read bandwidth, after everyone's last backward
        exchange = float(np.sum(one_sided_time(params * model.grad_bytes, world, hw) + fixed))
        # barriers: contributions complete, every owner has read them, new shards published
        step = float(per_rank.max()) + exchange + 3 * hw.barrier_lat
        return StepResult(step, busy, step - busy, float(tok.sum()), limit, exchange)
    bwd_t = _pass_time(bwd, rd + acc, hw.overlap)  # [W, K]
    if accumulate_locally:
        # a rank's microbatches are slots 0 .. count-1: only the last one adds into the owners' accumulators
        last = np.arange(present.shape[1])[None, :] == present.sum(axis=1, keepdims=True) - 1
        bwd_t = np.where(last, bwd_t, _pass_time(bwd, rd, hw.overlap))
    per_mb = passes * _pass_time(fwd, rd, hw.overlap) + bwd_t
    per_rank = np.where(present, per_mb, 0.0).sum(axis=1)
    step = float(per_rank.max()) + 2 * hw.barrier_lat  # barrier before the optimizer and after publishing
    return StepResult(step, busy, step - busy, float(tok.sum()), limit)
