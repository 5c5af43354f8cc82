"""Reading a ``calibration.json`` back: the measured cost of one model, for the planner and the simulator."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from odc_accelerate.planning import QuadraticCost

FORMAT = "odc-calibration/1"
WRITER = "python -m benchmarks.calibration --device cuda --out DIR"


class CalibrationError(ValueError):
    """A calibration file that cannot be used: malformed, or without the model asked for."""


@dataclass(frozen=True)
class CalibratedCost:
    """One model's measured forward + backward time per sequence, on the device the file was written on.

    Attributes:
        model (`str`): model name in the file (``"qwen2.5-1.5b"``).
        attn_implementation (`str`): attention kernel it was measured with.
        cost (`QuadraticCost`): ``linear * L + quadratic * L**2`` in seconds; as a planner cost only its ratios
            matter.
        intercept_s (`float`): fixed seconds per forward + backward, which `QuadraticCost` has no term for.
        max_rel_error (`float`): largest relative error of the fit over the measured points.
        lengths (`tuple[int, ...]`): measured lengths (the fit is an extrapolation outside them).
        device (`str`): device name.
        gradient_checkpointing (`bool`): whether the timings include the recompute of activation checkpointing.
        config (`dict`): the model's ``Qwen2Config`` keyword arguments.
        path (`str`): the file it came from.
    """

    model: str
    attn_implementation: str
    cost: QuadraticCost
    intercept_s: float
    max_rel_error: float
    lengths: tuple[int, ...]
    device: str
    gradient_checkpointing: bool
    config: dict[str, Any]
    path: str

    @property
    def seconds_per_token(self) -> float:
        """Seconds per token of the length-linear work (``cost.linear``): `cost` is already in seconds."""
        return self.cost.linear

    def seconds(self, lengths) -> np.ndarray | float:
        """Predicted seconds of one forward + backward of a sequence of each length (intercept included)."""
        out = self.cost(lengths)
        return out + self.intercept_s

    def describe(self) -> str:
        """Where the figures come from, in one line."""
        ckpt = ", activation checkpointing" if self.gradient_checkpointing else ""
        return (
            f"measured on {self.device} ({self.attn_implementation}{ckpt}; lengths {min(self.lengths)}-"
            f"{max(self.lengths)}, fit max error {self.max_rel_error:.1%}) from {self.path}"
        )


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str, path: Path) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise CalibrationError(f"{path}: {where} has no {key!r}. Write the file again with `{WRITER}`.")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise CalibrationError(f"{path}: {where}[{key!r}] must be a {names}, got {value!r}.")
    return value


def _coefficient(fit: dict, key: str, where: str, path: Path) -> float:
    value = float(_get(fit, key, (int, float), where, path))
    if not math.isfinite(value) or value < 0:
        raise CalibrationError(f"{path}: {where}[{key!r}] must be finite and >= 0, got {value}.")
    return value


def read_calibration(path: str | Path) -> dict[str, Any]:
    """The parsed file, checked for its format marker and a ``models`` list.

    Raises:
        FileNotFoundError: no such file (the message names the command that writes one).
        CalibrationError: not JSON, or not a calibration file.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "calibration.json"
    if not path.is_file():
        raise FileNotFoundError(f"No calibration file at {path}: write one on a GPU with `{WRITER}`.")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{path} is not valid JSON ({exc}). Write it again with `{WRITER}`.") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CalibrationError(
            f"{path} is not a calibration file (format {found!r}, expected {FORMAT!r}). Write one with `{WRITER}`."
        )
    _get(data, "models", list, "the file", path)
    return data


def calibrated_models(path: str | Path) -> list[str]:
    """Names of the models in the file that have a fit."""
    data = read_calibration(path)
    return [m["model"] for m in data["models"] if isinstance(m, dict) and m.get("fit") and "model" in m]


def load_calibration(path: str | Path, model: str, attn_implementation: str | None = None) -> CalibratedCost:
    """The measured cost of ``model`` from a ``calibration.json`` written by ``python -m benchmarks.calibration``.

    Args:
        path (`str` or `Path`): the file, or the folder holding it.
        model (`str`): model name as the file has it (``"qwen2.5-1.5b"``).
        attn_implementation (`str`, *optional*): which measurement when the file holds the model with several
            attention kernels; needed only then.

    Raises:
        FileNotFoundError: no such file.
        CalibrationError: malformed file, model not in it, model without a fit (every length failed), or several
            attention kernels and none chosen.
    """
    data = read_calibration(path)
    path = Path(path)
    if path.is_dir():
        path = path / "calibration.json"
    entries = []
    for i, entry in enumerate(data["models"]):
        where = f"models[{i}]"
        if _get(entry, "model", str, where, path) == model:
            _get(entry, "attn_implementation", str, where, path)
            entries.append((where, entry))
    if not entries:
        names = sorted({e.get("model") for e in data["models"] if isinstance(e, dict)} - {None})
        raise CalibrationError(
            f"{path} has no model {model!r} (it has {names or 'none'}). Measure it with `{WRITER} --models {model}`."
        )
    if attn_implementation is not None:
        entries = [(w, e) for w, e in entries if e["attn_implementation"] == attn_implementation]
        if not entries:
            raise CalibrationError(f"{path} has {model!r} but not with attn_implementation={attn_implementation!r}.")
    elif len(entries) > 1:
        kinds = [e["attn_implementation"] for _, e in entries]
        raise CalibrationError(f"{path} has {model!r} with several attention kernels {kinds}: choose one of them.")
    where, entry = entries[0]
    fit = entry.get("fit")
    if fit is None:
        reason = (
            entry.get("error") or entry.get("fit_error") or entry.get("stopped") or "fewer than 3 lengths measured"
        )
        raise CalibrationError(f"{path}: {model!r} has no fit ({reason}). Measure it again with `{WRITER}`.")
    fit_where = f"{where}['fit']"
    _get(entry, "fit", dict, where, path)
    linear = _coefficient(fit, "linear_s_per_token", fit_where, path)
    quadratic = _coefficient(fit, "quadratic_s_per_token2", fit_where, path)
    intercept = _coefficient(fit, "intercept_s", fit_where, path)
    max_err = _coefficient(fit, "max_rel_error", fit_where, path)
    if linear == 0 and quadratic == 0:
        raise CalibrationError(f"{path}: {fit_where} has no length-dependent term (linear and quadratic are 0).")
    points = _get(entry, "points", list, where, path)
    lengths = tuple(int(_get(p, "length", int, f"{where}['points']", path)) for p in points)
    if not lengths:
        raise CalibrationError(f"{path}: {where} has a fit but no measured points.")
    device = _get(data, "device", dict, "the file", path)
    return CalibratedCost(
        model=model,
        attn_implementation=entry["attn_implementation"],
        cost=QuadraticCost(linear=linear, quadratic=quadratic),
        intercept_s=intercept,
        max_rel_error=max_err,
        lengths=lengths,
        device=str(device.get("name", "unknown device")),
        gradient_checkpointing=bool(data.get("settings", {}).get("gradient_checkpointing", False)),
        config=dict(_get(entry, "config", dict, where, path)),
        path=str(path),
    )
