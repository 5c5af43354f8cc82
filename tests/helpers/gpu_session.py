"""The whole GPU procedure as one command: ``bash scripts/gpu_session.sh OUT_DIR [--device cpu]``.

Runs every case in turn, never two GPU jobs at once, each in its own process group under its own timeout, within one
overall budget (``--budget-s``, default 470 s: a 10-minute command on a lent GPU machine, with room for its start;
the CPU dry run allows 3 times the caps and the budget):

1. ``environment``: GPU, driver and package versions;
2. the engine-level cases of `gpu_check` (``refusals``, ``parity``, ``memory``, ``memory_policy``, ``speed``);
3. the Trainer-level cases of `gpu_trainer` (``sft_fp32``, ``dpo_fp32``, ``sft_bf16``, ``grpo``);
4. ``calibrate`` (`benchmarks.calibration`) with whatever time is left.

Each case writes into a work folder; at the end that folder is packed into ``OUT_DIR/session.tar.gz`` and the table of
cases (status, checks passed, seconds) goes to ``OUT_DIR/summary.txt`` and to stdout, last: two files, within the
eight a GPU machine sends back. With ``--device cpu`` (the dry run, in CI) the cases that exist on CPU run: parity
(the ``shm`` transport and the 'cuda' transport's protocol over shared memory), and the SFT and GRPO Trainer cases.
The exit code is 0 when every case that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK_CASES = ("refusals", "parity", "memory", "memory_policy", "speed")
TRAINER_CASES = ("sft_fp32", "dpo_fp32", "sft_bf16", "grpo")
CPU_CASES = ("check:parity", "trainer:sft_fp32", "trainer:grpo")
#: the most each case may take (seconds); the overall budget may cut it shorter
CAPS = {"refusals": 90, "parity": 150, "memory": 90, "memory_policy": 90, "speed": 150, "grpo": 150}
DEFAULT_CAP = 120
MIN_CASE_S = 20.0  # a case with less time left than this is not started
#: the CPU dry run's caps and budget are this many times the GPU's: its cases run slower, and no GPU time is at stake
CPU_SLACK = 3.0
RESERVE_S = 10.0  # kept back for packing the results


@dataclass
class Case:
    name: str  # "check:parity", "trainer:sft_fp32", "calibrate"
    status: str = "not run"
    passed: int = 0
    checks: int = 0
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)


def default_cases(device: str) -> list[str]:
    if device == "cpu":
        return list(CPU_CASES)
    return [f"check:{c}" for c in CHECK_CASES] + [f"trainer:{c}" for c in TRAINER_CASES] + ["calibrate"]


def _command(case: str, device: str, out: Path, seconds: float) -> list[str]:
    kind, _, name = case.partition(":")
    py = sys.executable
    if kind == "check":
        return [py, "-c", "import sys; from tests.helpers.gpu_check import main; sys.exit(main(sys.argv[1:]))",
                "--out", str(out), "--device", device, "--cases", name]  # fmt: skip
    if kind == "trainer":
        return [py, "-m", "tests.helpers.gpu_trainer", "--device", device, "--cases", name, "--out", str(out)]
    if kind == "calibrate":
        # The calibration keeps to its budget by itself; leave it the time its processes need to start and stop.
        budget = max(int(seconds - 75), 30)
        return [py, "-m", "benchmarks.calibration", "--device", device, "--out", str(out), "--budget-s", str(budget)]
    raise ValueError(f"unknown case {case!r}: use check:NAME, trainer:NAME or calibrate")


def _read_checks(case: Case, out: Path) -> None:
    """Count the case's checks from its ``results.json`` (gpu_check and gpu_trainer write ``checks`` dicts)."""
    path = out / "results.json"
    if not path.exists():
        return
    results = json.loads(path.read_text())
    for key, value in results.items():
        if isinstance(value, dict) and isinstance(value.get("checks"), dict):
            for check, ok in value["checks"].items():
                case.checks += 1
                case.passed += bool(ok)
                if not ok:
                    case.failed.append(f"{key}: {check}")


def run_case(case: Case, device: str, work: Path, seconds: float) -> None:
    out = work / case.name.replace(":", "_")
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # Two ranks on one GPU: torch's symmetric memory refuses that without this switch (the refusal case unsets it).
    env.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    start = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        # A session of its own, so that a timeout ends the case's launched ranks too, not only its driver.
        proc = subprocess.Popen(
            _command(case.name, device, out, seconds),
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=seconds)
            case.status = "pass" if rc == 0 else f"FAIL (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            case.status = f"TIMEOUT ({seconds:.0f} s)"
    case.seconds = round(time.perf_counter() - start, 1)
    _read_checks(case, out)
    if case.name == "calibrate" and case.status == "pass":
        case.checks = case.passed = 1  # it has no checks of its own: it ran and wrote its fit


def table(cases: list[Case], device: str, total_s: float) -> str:
    lines = [f"GPU session ({device}), {total_s:.0f} s", f"{'case':<24} {'status':<18} {'checks':>8} {'s':>7}"]
    for c in cases:
        checks = f"{c.passed}/{c.checks}" if c.checks else "-"
        lines.append(f"{c.name:<24} {c.status:<18} {checks:>8} {c.seconds:>7.1f}")
    failed = [f"  {c.name}: {f}" for c in cases for f in c.failed]
    if failed:
        lines += ["failed checks:", *failed]
    return "\n".join(lines) + "\n"


def _environment(work: Path) -> None:
    lines = [time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())]
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version", "--format=csv"],
            capture_output=True,
            text=True,
        )
        lines.append(smi.stdout.strip())
    import importlib.metadata as metadata

    lines.append(f"python {sys.version.split()[0]}")
    for name in ("torch", "triton", "numpy", "transformers", "accelerate", "trl", "datasets", "pyarrow"):
        try:
            lines.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{name} -")
    (work / "env.txt").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--cases", default=None, help="comma-separated subset, e.g. check:parity,trainer:grpo,calibrate")
    p.add_argument(
        "--budget-s", type=float, default=None, help="seconds for every case together (default 470; on cpu 3 x that)"
    )
    args = p.parse_args(argv)
    slack = CPU_SLACK if args.device == "cpu" else 1.0
    budget = args.budget_s if args.budget_s is not None else 470.0 * slack
    names = args.cases.split(",") if args.cases else default_cases(args.device)
    for name in names:
        try:
            _command(name, args.device, Path("."), 0)  # an unknown case stops here, before any work
        except ValueError as err:
            p.error(str(err))
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "session"
    work.mkdir(exist_ok=True)
    start = time.perf_counter()
    _environment(work)
    cases = [Case(name) for name in names]
    for case in cases:
        left = budget - (time.perf_counter() - start) - RESERVE_S
        own = CAPS.get(case.name.split(":")[-1], DEFAULT_CAP) * slack
        cap = left if case.name == "calibrate" else min(own, left)
        if cap < MIN_CASE_S:
            case.status = "skipped (no time)"
            continue
        print(f"[gpu_session] {case.name} (up to {cap:.0f} s) ...", flush=True)
        run_case(case, args.device, work, cap)
        print(f"[gpu_session] {case.name}: {case.status}, {case.passed}/{case.checks} checks", flush=True)
    summary = table(cases, args.device, time.perf_counter() - start)
    (work / "summary.txt").write_text(summary)
    with tarfile.open(args.out / "session.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="session")
    shutil.rmtree(work)
    (args.out / "summary.txt").write_text(summary)
    print(summary, end="")
    ran = [c for c in cases if c.status != "skipped (no time)"]
    return 0 if ran and all(c.status == "pass" and c.passed == c.checks for c in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
