"""`ODCConfig`: every ODC option, defined once.

Each option is one field; its metadata names it on every other surface: ``key`` (the ``fsdp_config`` key, training
argument and flag, ``odc_transport``) and ``env`` (the variable ``odc-accelerate launch`` exports, ``ODC_TRANSPORT``).
`ODCConfig.from_sources` resolves one run's options (explicit values, then ``fsdp_config``, then the environment, then
the defaults); a constructed config is read-only. What a trainer derives at run time lives on
`~odc_accelerate.integrations.trainer.run.ODCRun`. The options: docs/configuration.md.
"""

import json
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import Field, FrozenInstanceError, dataclass, field, fields
from typing import Any, ClassVar

from .planning import PlanName, normalize_plan
from .reduction import REDUCTIONS, ReductionName, normalize_reduction
from .validation import check_positive_int, str_to_bool

__all__ = [
    "ODCConfig",
    "env_from_fsdp_config",
    "option_fields",
    "options_from_fsdp_config",
    "training_args_fields",
]

# Which surface switched ODC on, recorded in `ODCConfig.source` (run reports say where a setting came from).
SOURCES = ("default", "args", "fsdp_config", "env")
# What `ODCConfig.metrics` accepts.
METRICS = ("summary", "per_rank", "off")


def _option(default: Any, key: str, env: str, help: str, kind: type) -> Any:
    # ``kind`` is the option's value type; the field's annotation also admits None ("not set here").
    return field(default=None, metadata={"key": key, "env": env, "help": help, "default": default, "kind": kind})


# Spellings that still work for one release, each with a FutureWarning: old name -> option.
_DEPRECATED_KEYS = {"odc_balance": "plan"}
_DEPRECATED_SECTION_KEYS = {"balance": "plan"}
_DEPRECATED_ENV = {"ODC_BALANCE": "plan"}


@dataclass(kw_only=True)
class ODCConfig:
    """Settings of On-Demand Communication for one run.

    Fields left `None` are "not set": `ODCConfig.from_sources` fills them from the next source, and construction
    fills what is still unset with the defaults below, then validates. Once constructed the config is read-only:
    assigning to it raises `dataclasses.FrozenInstanceError`, and `dataclasses.replace(config, plan="lockstep")` makes a
    changed (re-validated) copy.

    Args:
        enable (`bool`, *optional*, defaults to `False`; key `odc`, env `ODC_ENABLE`):
            Run FSDP2 with ODC's one-sided gathers and scatter-accumulates instead of its per-layer collectives.
            Needs an FSDP2 launch (``distributed_type: FSDP``, ``fsdp_version: 2``). `ODCPlugin` defaults to `True`.
        transport (`str`, *optional*, defaults to `"auto"`; key `odc_transport`, env `ODC_TRANSPORT`):
            How ranks reach each other's shards: ``auto``, ``shm``, ``network``, ``hierarchical`` or ``cuda`` (see
            `odc_accelerate.transport`). In Python a `~odc_accelerate.transport.Transport` instance is accepted too.
        timeout (`float`, *optional*, defaults to 600; key `odc_timeout`, env `ODC_TIMEOUT`):
            Seconds any ODC wait may last before `ODCTimeoutError` names the rank that did not arrive.
        max_tokens_per_microbatch (`int`, *optional*; key `odc_max_tokens_per_microbatch`, env
            `ODC_MAX_TOKENS_PER_MICROBATCH`):
            Token budget of one microbatch for the length-balanced plan; unset, the trainer uses ``max_length``.
        plan (`PlanName`, *optional*; key `odc_plan`, env `ODC_PLAN`):
            How each optimizer step's samples are split into microbatches over the ranks. ``"free"``: per-rank
            totals balanced, each rank runs as many microbatches as its share needs (needs ODC). ``"lockstep"``:
            every rank runs the same number of microbatches, each slot balanced (what plain FSDP2 needs).
            ``"dynamic"``: one queue of the step's microbatches, costliest first, from which each rank claims the next
            one when it is free (balance that survives cost-model error and slower devices; needs ODC). Defaults to
            ``"free"`` with ODC; set without ODC, plain FSDP2 trains on the planned microbatches (for comparisons). A
            name given as a string becomes its `PlanName`.
        reproducible (`bool`, *optional*, defaults to `False`; key `odc_reproducible`, env `ODC_REPRODUCIBLE`):
            With ``plan="dynamic"``, plan every step with the static ``"free"`` plan instead, so that which rank runs
            which microbatch depends on the data alone, not on the ranks' timing (per-rank random streams such as
            dropout, traces and per-rank metrics repeat from run to run). No effect on the other plans.
        samples_per_step (`int`, *optional*; key `odc_samples_per_step`, env `ODC_SAMPLES_PER_STEP`):
            Samples of one optimizer step over all ranks; unset, ``per_device_train_batch_size x
            gradient_accumulation_steps x world size``.
        trace_dir (`str`, *optional*; key `odc_trace_dir`, env `ODC_TRACE_DIR`):
            Write one JSON line per optimizer step to ``<trace_dir>/trace_rank<r>.jsonl``: the step's microbatch
            shapes and its time (see `odc_accelerate.telemetry.StepTrace`).
        time_collectives (`bool`, *optional*, defaults to `False`; key `odc_time_collectives`, env
            `ODC_TIME_COLLECTIVES`):
            On plain FSDP2 runs, time FSDP2's collectives (run synchronously) and the blocking ``torch.distributed``
            calls, so that per-rank wait is reported (see `odc_accelerate.telemetry.CollectiveTimer`).
        metrics (`str`, *optional*; key `odc_metrics`, env `ODC_METRICS`):
            The ``odc/*`` step metrics logged by the ODC trainers. ``"summary"``: tokens/s, step time, bubble,
            microbatch counts, and the minimum, maximum and mean over ranks of busy and wait time; ``"per_rank"``: also
            each rank's busy and wait time (``odc/busy_s_rank<r>``, ...); ``"off"``: none. Defaults to ``"summary"``
            when ODC, a plan or collective timing is on, else ``"off"``.
        memory_policy (`str`, *optional*, defaults to `"neither"`; key `odc_memory_policy`, env `ODC_MEMORY_POLICY`):
            What each rank keeps unsharded through an optimizer step, per FSDP2 param group: ``"params"`` (gathered
            once per step), ``"grads"`` (reduced once per step), ``"both"``, ``"neither"`` (memory bounded by the
            shard, the accumulator and one microbatch), ``"auto"`` (each rank from its own free memory, re-chosen
            every step), or ``pattern=choice`` pairs matched against group FQNs (``"<root>=params,*layers.*=both"``).
            See `odc_accelerate.engine.memory`. The default keeps the memory of FSDP2 reducing every microbatch;
            ``"grads"`` is what the ODC Trainer did before this option (one reduce per step).
        memory_headroom (`str`, *optional*, defaults to `"30%"`; key `odc_memory_headroom`, env
            `ODC_MEMORY_HEADROOM`):
            What ``memory_policy="auto"`` leaves free for activations and the optimizer: a percentage of the rank's
            memory (``"30%"``) or a size (``"4GiB"``, ``"512MB"``).
        reduction (`ReductionName`, *optional*, defaults to `"auto"`; key `odc_reduction`, env `ODC_REDUCTION`):
            How a step's gradients reach their owners. ``"auto"``: the transport decides, ``"atomic"`` where its adds
            are atomic (every CPU transport; ``cuda`` over GPUs with native peer-to-peer atomics and deterministic
            algorithms off), else ``"ordered"``. ``"atomic"``: each microbatch's gradient slices are added into
            their owners' accumulators as ranks finish them (the sum's order varies, so runs differ in the last bits).
            ``"ordered"``: each rank sums its own gradient for the step locally, in its microbatches' order, and each
            owner sums the ranks' contributions in rank order once per step: bitwise reproducible, no remote atomics
            (GPUs without native peer-to-peer atomics), one unsharded gradient per rank in memory. See
            ``docs/reduction.md``.

    Attributes:
        source (`str`): where ``enable`` was set: ``"args"``, ``"fsdp_config"``, ``"env"`` or ``"default"``.
        given (`dict[str, str]`): the options set by a source other than the defaults, by field name, with that
            source (``{"plan": "env"}``).
    """

    enable: bool | None = _option(False, "odc", "ODC_ENABLE", "Run FSDP2 with On-Demand Communication (ODC).", bool)
    transport: Any = _option(
        "auto", "odc_transport", "ODC_TRANSPORT", "ODC transport: auto, shm, network, hierarchical or cuda.", str
    )
    timeout: float | None = _option(
        600.0, "odc_timeout", "ODC_TIMEOUT", "Seconds an ODC wait may last before naming the missing rank.", float
    )
    max_tokens_per_microbatch: int | None = _option(
        None,
        "odc_max_tokens_per_microbatch",
        "ODC_MAX_TOKENS_PER_MICROBATCH",
        "Token budget of one microbatch for the length-balanced plan (default: max_length).",
        int,
    )
    plan: PlanName | None = _option(
        None,
        "odc_plan",
        "ODC_PLAN",
        "Microbatch plan of each step: 'free' (balanced per-rank totals, any microbatch count per rank; needs ODC) "
        "'lockstep' (equal counts, each slot balanced) or 'dynamic' (ranks claim the step's next microbatch when free; "
        "needs ODC). Defaults to 'free' with ODC; without ODC, plain FSDP2 trains on the planned microbatches.",
        str,
    )
    reproducible: bool | None = _option(
        False,
        "odc_reproducible",
        "ODC_REPRODUCIBLE",
        "With odc_plan 'dynamic': plan each step with the static 'free' plan instead, so that which rank runs which "
        "microbatch depends on the data alone (run-to-run reproducible).",
        bool,
    )
    samples_per_step: int | None = _option(
        None,
        "odc_samples_per_step",
        "ODC_SAMPLES_PER_STEP",
        "Samples per optimizer step over all ranks (default per_device_train_batch_size x "
        "gradient_accumulation_steps x world size).",
        int,
    )
    trace_dir: str | None = _option(
        None, "odc_trace_dir", "ODC_TRACE_DIR", "Write per-step microbatch shapes and times to this folder.", str
    )
    time_collectives: bool | None = _option(
        False,
        "odc_time_collectives",
        "ODC_TIME_COLLECTIVES",
        "Plain FSDP2: time collectives (run synchronously) to report per-rank wait.",
        bool,
    )
    metrics: str | None = _option(
        None,
        "odc_metrics",
        "ODC_METRICS",
        "odc/* step metrics: 'summary' (min/max/mean over ranks), 'per_rank' (also each rank's) or 'off'. Defaults to "
        "'summary' with ODC, a plan or collective timing, else 'off'.",
        str,
    )
    memory_policy: str | None = _option(
        "neither",
        "odc_memory_policy",
        "ODC_MEMORY_POLICY",
        "What each rank keeps unsharded through a step, per param group: params (gather once), grads (reduce once), "
        "both, neither (bounded memory), auto (from free memory), or pattern=choice pairs.",
        str,
    )
    memory_headroom: str | None = _option(
        "30%",
        "odc_memory_headroom",
        "ODC_MEMORY_HEADROOM",
        "Memory that memory_policy=auto leaves free: a percentage of the rank's memory (default 30 percent) or a size "
        "such as 4GiB.",
        str,
    )
    reduction: ReductionName | None = _option(
        ReductionName.AUTO,
        "odc_reduction",
        "ODC_REDUCTION",
        f"How gradients reach their owners: {', '.join(REDUCTIONS)}. 'auto' lets the transport decide (atomic where "
        "its adds are atomic, else ordered); 'atomic' adds each microbatch's gradients into the owners as ranks "
        "finish (order varies); 'ordered' sums each rank's step locally and each owner sums the ranks in rank order "
        "once per step (bitwise reproducible, no peer atomics, one unsharded gradient per rank).",
        str,
    )
    source: str = field(default="default", compare=False, repr=False)
    given: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in option_fields():
            if getattr(self, f.name) is None:
                setattr(self, f.name, f.metadata["default"])
        self._validate()
        self._freeze()

    # ------------------------------------------------------------------ read-only once resolved
    # Not `frozen=True`: `ODCPlugin` is also a (mutable) accelerate plugin, and construction coerces values in place.
    #: Names that are read-only once resolved; `None`: every attribute (`ODCPlugin` names its ODC fields only).
    _read_only_names: ClassVar[frozenset[str] | None] = None

    def _freeze(self) -> None:
        object.__setattr__(self, "_resolved", True)

    def __setattr__(self, name: str, value: Any) -> None:
        self._check_writable(name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self._check_writable(name)
        object.__delattr__(self, name)

    def _check_writable(self, name: str) -> None:
        if not self.__dict__.get("_resolved", False):
            return
        if self._read_only_names is None or name in self._read_only_names:
            raise FrozenInstanceError(
                f"{type(self).__name__} is resolved once per run and read-only: cannot set {name!r}. Make a changed "
                f"copy with dataclasses.replace(config, {name}=...); values a trainer derives at run time (samples "
                "per step, the chosen token budget, the folded gradient accumulation) are on its odc_run."
            )

    # ------------------------------------------------------------------ derived
    @property
    def balanced(self) -> bool:
        """Whether steps are planned by the length-balanced sampler (always with ODC)."""
        return self.plan is not None

    @property
    def effective_plan(self) -> PlanName | None:
        """The plan steps are made with: ``plan``, except ``"free"`` for ``"dynamic"`` under ``reproducible``."""
        return PlanName.FREE if self.plan == PlanName.DYNAMIC and self.reproducible else self.plan

    def options(self) -> dict[str, Any]:
        """The option fields as a dict (``source`` excluded)."""
        return {f.name: getattr(self, f.name) for f in option_fields()}

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        """Coerce option values to their types and raise one `ValueError` naming the option to change (at
        construction, before the config is read-only)."""
        from .transport import TRANSPORTS, Transport

        self.enable = str_to_bool(self.enable, _name("enable"))
        self.time_collectives = str_to_bool(self.time_collectives, _name("time_collectives"))
        self.reproducible = str_to_bool(self.reproducible, _name("reproducible"))
        if not isinstance(self.transport, Transport):
            if self.transport not in TRANSPORTS:
                raise ValueError(
                    f"Unknown {_name('transport')} {self.transport!r}; choose one of {', '.join(TRANSPORTS)}."
                )
        try:
            timeout = float(self.timeout)
        except (TypeError, ValueError):
            timeout = -1.0
        if isinstance(self.timeout, bool) or not timeout > 0:
            raise ValueError(f"{_name('timeout')} must be a positive number of seconds, got {self.timeout!r}.")
        self.timeout = timeout
        for name in ("max_tokens_per_microbatch", "samples_per_step"):
            if getattr(self, name) is not None:
                setattr(self, name, check_positive_int(getattr(self, name), _name(name)))
        if self.enable and self.plan is None:
            self.plan = PlanName.FREE
        if self.plan is not None:
            self.plan = normalize_plan(self.plan, where=_name("plan"))
        if self.plan == PlanName.DYNAMIC and not self.enable:
            raise ValueError(
                f"{_name('plan')} 'dynamic' needs ODC: ranks claim microbatches while the step runs, so they run "
                "different numbers of microbatches, which plain FSDP2's collectives cannot pair. Turn ODC on "
                f"({_name('enable')}) or choose 'free' / 'lockstep'."
            )
        if self.trace_dir is not None:
            self.trace_dir = os.fspath(self.trace_dir)
        if self.metrics is None:
            self.metrics = "summary" if (self.enable or self.balanced or self.time_collectives) else "off"
        self.metrics = str(self.metrics).strip().lower()
        if self.metrics not in METRICS:
            raise ValueError(f"{_name('metrics')} must be one of {', '.join(METRICS)}, got {self.metrics!r}.")
        from . import memory_spec

        for name, check in (
            ("memory_policy", memory_spec.parse_policy),
            ("memory_headroom", memory_spec.parse_headroom),
        ):
            value = getattr(self, name)
            if isinstance(value, str):
                value = value.strip()
                setattr(self, name, value.lower() if "=" not in value else value)
            try:
                check(value)
            except ValueError as err:
                raise ValueError(f"{_name(name)}: {err}.") from None
        # Checked, not rewritten: the resolved config is not written to; a valid name equals its `ReductionName`.
        normalize_reduction(self.reduction, where=_name("reduction"))
        if self.source not in SOURCES:
            raise ValueError(f"ODCConfig.source must be one of {', '.join(SOURCES)}, got {self.source!r}.")

    # ------------------------------------------------------------------ resolution
    @classmethod
    def from_sources(
        cls,
        *,
        overrides: Mapping[str, Any] | None = None,
        args: Any = None,
        fsdp_config: Mapping[str, Any] | str | None = None,
        env: Mapping[str, str] | None = None,
        enable_default: bool = False,
    ) -> "ODCConfig":
        """Resolve the options of one run, first source that sets an option wins.

        Args:
            overrides (`Mapping[str, Any]`, *optional*):
                Explicit values by field name (e.g. the `ODCPlugin` constructor's); `None` values count as unset.
            args (*optional*):
                Training arguments with fields named by the options' keys (``args.odc``, ``args.odc_transport``,
                ...; `None` = unset). Their ``fsdp_config`` is read when ``fsdp_config`` is not given.
            fsdp_config (`Mapping` or `str`, *optional*):
                An ``fsdp_config`` mapping, or the path of a JSON file holding one (``--fsdp_config file.json``).
                ODC options appear as flat keys (``odc: true``, ``odc_transport: shm``) or as one ``odc`` section
                (``"odc": {"enable": true, "transport": "shm"}``).
            env (`Mapping[str, str]`, *optional*, defaults to `os.environ`):
                ``ODC_*`` variables (``odc-accelerate launch`` exports the config file's keys this way).
            enable_default (`bool`, *optional*, defaults to `False`):
                The value of ``enable`` when no source sets it.

        Raises:
            ValueError: an invalid value or an unknown ``odc*`` key, naming it.
            TypeError: ``overrides`` names a field that is not an option.
        """
        layers: list[tuple[str, dict[str, Any]]] = []
        if overrides:
            unknown = set(overrides) - {f.name for f in option_fields()}
            if unknown:
                raise TypeError(f"Unknown ODC option(s): {', '.join(sorted(unknown))}.")
            layers.append(("args", {k: v for k, v in overrides.items() if v is not None}))
        if args is not None:
            layers.append(("args", _from_args(args)))
            if fsdp_config is None:
                fsdp_config = getattr(args, "fsdp_config", None)
        if fsdp_config:
            layers.append(("fsdp_config", options_from_fsdp_config(_load_mapping(fsdp_config))))
        layers.append(("env", _from_env(os.environ if env is None else env)))

        values: dict[str, Any] = {}
        given: dict[str, str] = {}
        for name in (f.name for f in option_fields()):
            for layer_source, layer in layers:
                if name in layer:
                    values[name], given[name] = layer[name], layer_source
                    break
        if "enable" not in values:
            values["enable"] = enable_default
        return cls(**values, source=given.get("enable", "default"), given=given)


# ---------------------------------------------------------------------- field helpers
def option_fields() -> Iterator[Field]:
    """The option fields of `ODCConfig` (those with a config key), in definition order."""
    return (f for f in fields(ODCConfig) if "key" in f.metadata)


def _name(field_name: str) -> str:
    f = _field(field_name)
    return f"{f.metadata['key']} ({f.metadata['env']})"


def _env_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}.", FutureWarning, 3)


def _from_args(args: Any) -> dict[str, Any]:
    out = {}
    for f in option_fields():
        value = getattr(args, f.metadata["key"], None)
        if value is not None:
            out[f.name] = value
    for old, name in _DEPRECATED_KEYS.items():
        value = getattr(args, old, None)
        if value is not None:
            _deprecated(f"--{old}", f"--{_key(name)}")
            out.setdefault(name, value)
    return out


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out = {}
    for f in option_fields():
        value = env.get(f.metadata["env"])
        if value:  # an empty variable counts as unset
            out[f.name] = value
    for old, name in _DEPRECATED_ENV.items():
        if env.get(old):
            _deprecated(old, _field(name).metadata["env"])
            out.setdefault(name, env[old])
    return out


def _key(name: str) -> str:
    return _field(name).metadata["key"]


def _field(name: str) -> Field:
    return next(f for f in option_fields() if f.name == name)


def _load_mapping(config: Mapping[str, Any] | str) -> Mapping[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        # TrainingArguments only loads --fsdp_config when --fsdp is set; the ODC options count either way.
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, Mapping):
        raise ValueError(f"fsdp_config must be a mapping or a JSON file path, got {type(config).__name__}.")
    return config


def options_from_fsdp_config(fsdp_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ODC options an ``fsdp_config`` mapping sets, by field name.

    Reads flat keys (``odc``, ``odc_transport``, ...) and an ``odc`` section given as a mapping of field names
    (``{"enable": true, "transport": "shm"}``).

    Raises:
        ValueError: an ``odc*`` key or section key that is not an ODC option, listing the known ones.
    """
    by_key = {f.metadata["key"]: f.name for f in option_fields()}
    names = {f.name for f in option_fields()}
    out: dict[str, Any] = {}
    section = fsdp_config.get("odc")
    if isinstance(section, Mapping):
        for key, value in section.items():
            if key in _DEPRECATED_SECTION_KEYS:
                _deprecated(f"fsdp_config's odc.{key}", f"odc.{_DEPRECATED_SECTION_KEYS[key]}")
                key = _DEPRECATED_SECTION_KEYS[key]
            if key not in names:
                raise ValueError(
                    f"Unknown key {key!r} in fsdp_config's odc section; known keys: {', '.join(sorted(names))}."
                )
            out[key] = value
    elif section is not None:
        out["enable"] = str_to_bool(section, "fsdp_config's odc")
    for key, value in fsdp_config.items():
        if not key.startswith("odc") or key == "odc":
            continue
        if key in _DEPRECATED_KEYS:
            _deprecated(f"fsdp_config key {key}", _key(_DEPRECATED_KEYS[key]))
            out.setdefault(_DEPRECATED_KEYS[key], value)
        elif key in by_key:
            out[by_key[key]] = value
        else:
            raise ValueError(f"Unknown ODC key {key!r} in fsdp_config; known keys: {', '.join(by_key)}.")
    return out


def env_from_fsdp_config(fsdp_config: Mapping[str, Any]) -> dict[str, str]:
    """The ``ODC_*`` variables that carry an ``fsdp_config``'s ODC options to worker processes (launcher)."""
    return {
        _field(name).metadata["env"]: _env_text(value) for name, value in options_from_fsdp_config(fsdp_config).items()
    }


def training_args_fields() -> list[tuple[str, Any, Any]]:
    """``(name, type, field)`` triples declaring every option as a training-argument field named by its key
    (``odc``, ``odc_transport``, ...; default `None` = not set), plus the deprecated spellings. For
    `dataclasses.make_dataclass`; the TRL configs are built from them."""
    out = []
    for f in option_fields():
        kind = f.metadata["kind"]
        out.append((f.metadata["key"], kind | None, field(default=None, metadata={"help": f.metadata["help"]})))
    for old, name in _DEPRECATED_KEYS.items():
        kind = _field(name).metadata["kind"]
        help_text = f"Deprecated spelling of --{_key(name)} (removed in the next release)."
        out.append((old, kind | None, field(default=None, metadata={"help": help_text})))
    return out
