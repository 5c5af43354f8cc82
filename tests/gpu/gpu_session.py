"""The whole GPU procedure as one command: ``bash scripts/gpu_session.sh OUT_DIR [--device cpu]``.

Runs every case in turn, never two cases at once, each in its own process group under its own cap, within one overall
budget (``--budget-s``, default 470 s: a 10-minute command on a lent GPU machine, with room for its start and the
wheels' install; the CPU dry run allows 3 times the caps and the budget). The default cases, in order (`GPU_CASES`;
`CAPS` holds each one's cap):

1. ``environment``: GPU, driver, package versions and the package's commit (``ODC_GPU_COMMIT``, else git);
2. the engine-level cases of `gpu_check`: ``refusals``, ``parity``, ``ranks8`` (8 ranks on the GPU: parity, the
   dynamic plan's claims, 7 ranks adding into one owner's shard at once), ``memory``, ``ordered`` (the ordered
   gradient reduction's step time against ``atomic``, and two ordered runs ending bitwise equal);
3. the Trainer-level cases of `gpu_trainer`: ``sft_fp32`` (2 and 8 ranks, the free and the dynamic plan, against TRL
   in one process), ``dpo_fp32``, ``sft_bf16``, ``grpo``;
4. ``check:speed``, the accumulate paths at 1 GiB;
5. ``trainer:speed`` (`trainer_speed`: ODC against the zero-communication limit on a Qwen2.5-0.5B-shaped model), last:
   it runs as many interleaved repeats as the time left allows.

Left out by default, being stored twice already (``benchmarks/gpu/``): ``check:memory_policy`` and ``calibrate``
(`benchmarks.calibration`, with whatever time is left); ``--cases`` runs them.

Each case writes into a work folder; at the end that folder is packed into ``OUT_DIR/session.tar.gz``, the speed
case's ``trainer_speed.json`` is copied to ``OUT_DIR`` and the table of cases (status, checks passed, seconds) goes to
``OUT_DIR/summary.txt`` and to stdout, last: three files, within the eight a GPU machine sends back. With ``--device
cpu`` (the dry run, in CI) the cases that exist on CPU run (`CPU_CASES`): parity (the ``shm`` transport and the
'cuda' transport's protocol over shared memory), ranks8 and ordered (the protocol), the SFT Trainer case (2 and 8
ranks), GRPO and the speed case on a tiny model. The exit code is 0 when every case that ran passed.
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

from .gpu_trainer import root_first

ROOT = Path(__file__).resolve().parents[2]
GPU_CASES = (
    "check:refusals", "check:parity", "check:ranks8", "check:memory", "check:ordered", "trainer:sft_fp32",
    "trainer:dpo_fp32", "trainer:sft_bf16", "trainer:grpo", "check:speed", "trainer:speed",
)  # fmt: skip
CPU_CASES = ("check:parity", "check:ranks8", "check:ordered", "trainer:sft_fp32", "trainer:grpo", "trainer:speed")
#: the most each case may take (seconds, on a GPU); the overall budget may cut it shorter. From the H100 runs of
#: 2026-11-27 (benchmarks/gpu/h100-2026-11-27): refusals 25 s, parity 35 s, memory 17 s, memory_policy 19 s, each
#: Trainer case about 50 s with its runs one after another (now at once), GRPO 50 s, calibration 71 s. check:ordered
#: has not run on a GPU yet: three launches of 2 ranks on the toy LM, estimated 30-40 s.
CAPS = {
    "check:refusals": 60,
    "check:parity": 90,
    "check:ranks8": 90,
    "check:memory": 60,
    "check:ordered": 90,
    "check:memory_policy": 60,
    "check:speed": 60,
    "trainer:sft_fp32": 120,
    "trainer:dpo_fp32": 90,
    "trainer:sft_bf16": 90,
    "trainer:grpo": 120,
    "trainer:speed": 180,
}
DEFAULT_CAP = 120
MIN_CASE_S = 20.0  # a case with less time left than this is not started
#: the CPU dry run's caps and budget are this many times the GPU's: its cases run slower, and no GPU time is at stake
CPU_SLACK = 3.0
RESERVE_S = 10.0  # kept back for packing the results
#: files a case leaves in its work folder that come back beside the archive (the speed case's, for benchmarks/gpu/)
RETURNED = {"trainer:speed": "trainer_speed.json"}


@dataclass
class Case:
    name: str  # "check:parity", "trainer:sft_fp32", "calibrate"
    status: str = "not run"
    passed: int = 0
    checks: int = 0
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)


def default_cases(device: str) -> list[str]:
    return list(CPU_CASES if device == "cpu" else GPU_CASES)


#: the case names of each checker (`gpu_check.CASES`, `gpu_trainer.CASES`; not imported: they import torch)
NAMES = {
    "check": ("refusals", "parity", "ranks8", "memory", "ordered", "memory_policy", "speed"),
    "trainer": ("sft_fp32", "dpo_fp32", "sft_bf16", "grpo", "speed"),
}


def _command(case: str, device: str, out: Path, seconds: float) -> list[str]:
    kind, _, name = case.partition(":")
    if kind in NAMES and name not in NAMES[kind]:
        raise ValueError(f"unknown case {case!r}: {kind}:NAME takes {', '.join(NAMES[kind])}")
    py = sys.executable
    if kind == "check":
        return [py, "-c", "import sys; from tests.gpu.gpu_check import main; sys.exit(main(sys.argv[1:]))",
                "--out", str(out), "--device", device, "--cases", name]  # fmt: skip
    if kind == "trainer":
        cmd = [py, "-m", "tests.gpu.gpu_trainer", "--device", device, "--cases", name, "--out", str(out)]
        if name == "speed":  # it plans its repeats to end within its cap, leaving time to stop
            cmd += ["--budget-s", str(max(int(seconds - 15), 30))]
        return cmd
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
    env = dict(os.environ, PYTHONPATH=root_first(os.environ.get("PYTHONPATH")))
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

    from .trainer_speed import commit

    lines.append(f"commit {commit() or '-'}")
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
    p.add_argument("--cases", default=None, help="comma-separated, e.g. check:parity,trainer:grpo,calibrate")
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
        own = CAPS.get(case.name, DEFAULT_CAP) * slack
        cap = left if case.name == "calibrate" else min(own, left)
        if cap < MIN_CASE_S:
            case.status = "skipped (no time)"
            continue
        print(f"[gpu_session] {case.name} (up to {cap:.0f} s) ...", flush=True)
        run_case(case, args.device, work, cap)
        print(f"[gpu_session] {case.name}: {case.status}, {case.passed}/{case.checks} checks", flush=True)
    summary = table(cases, args.device, time.perf_counter() - start)
    (work / "summary.txt").write_text(summary)
    for case, name in RETURNED.items():
        path = work / case.replace(":", "_") / name
        if path.exists():
            shutil.copy(path, args.out / name)
    with tarfile.open(args.out / "session.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="session")
    shutil.rmtree(work)
    (args.out / "summary.txt").write_text(summary)
    print(summary, end="")
    ran = [c for c in cases if c.status != "skipped (no time)"]
    return 0 if ran and all(c.status == "pass" and c.passed == c.checks for c in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
