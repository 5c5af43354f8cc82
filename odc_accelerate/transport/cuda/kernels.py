"""Triton kernels of the CUDA transport: ``accumulate_(dst, src)``, one fused cast-and-atomic-add.

``dst += src`` (1-D, ``dst`` possibly a peer's accumulator mapped through symmetric memory), ``src`` read in its own
dtype and added with system-scope atomics, staging nothing. Triton is imported on first use; `kernel_available` says
without compiling whether the kernel can run, `probe` compiles and launches it once at set-up; the transport falls back
to ``index_add_`` where either says no. CPU tensors run it under ``TRITON_INTERPRET=1`` (tests). Launch parameters
(`BLOCK`, `NUM_WARPS`, the ``sm_share`` grid cap) and their measurements: docs/transports.md, "The accumulate kernel".
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import torch

#: elements each program adds per loop iteration: 64 per thread at 4 warps, i.e. sixteen 16-byte fp32 reductions in
#: flight per thread. Measured on one H100 (Triton 3.6, 256 MiB, grid of a quarter of the SMs): 779 GB/s of fp32
#: source and 296 of bf16 at 8192, against 398 and 165 at 2048 (`tests/gpu/accumulate_sweep.py`, docs/gpu.md)
BLOCK = 8192
#: warps per program
NUM_WARPS = 4
#: share of the GPU's SMs the grid may cover when adding an fp32 source (`default_sm_share`). Chosen from the sweep
#: stored in ``benchmarks/gpu/h100-2026-11-27/accumulate_sweep.json`` (one H100, Triton 3.6, 256 MiB, `BLOCK` 8192, 4
#: warps; the non-atomic ``add_`` ran at 1002 GB/s of fp32 source and 485 of bf16): a quarter of the SMs (33
#: programs) adds 779 GB/s of fp32 source, 0.78 of ``add_``, and half only 843 (0.84); the speed case of
#: ``speed_results.json`` beside it measured 0.73-0.78 at a quarter. A quarter leaves three quarters of the SMs to the
#: backward pass the adds run beside.
DEFAULT_SM_SHARE = 0.25
#: share of the SMs for a 16-bit (bf16, fp16) source. The same sweep: a quarter of the SMs adds only 296 GB/s of bf16
#: source, 0.61 of ``add_`` (0.59 in ``speed_results.json``), half 464 GB/s, 0.96 (0.94), and all of them 478 (0.99):
#: half gains 57% over a quarter for a bf16 source, against 8% for an fp32 one
DEFAULT_SM_SHARE_16BIT = 0.5
#: programs under Triton's interpreter (CPU tensors): more than one, so that the grid-stride loop is exercised
INTERPRETER_PROGRAMS = 3
#: elements per launch: offsets stay within int32 (one add of more elements takes several launches)
MAX_LAUNCH_NUMEL = 2**30
#: source dtypes the kernel reads
SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: accumulator dtypes the kernel adds into
ACCUMULATOR_DTYPES = (torch.float32, torch.bfloat16)
#: elements of the set-up `probe`: a whole block (the unmasked loop) and a ragged tail (the masked add)
PROBE_NUMEL = BLOCK + 5
#: programs of the set-up `probe`: two, so that the tail is added by a program other than the first
PROBE_PROGRAMS = 2
#: the oldest Triton whose interpreter runs the kernel: 3.6's turns the grid-stride loop's bounds into Python ints with
#: ``int()`` of a 1-element array, which numpy 2.4 refuses (3.7 squeezes it first); compiled GPU kernels are unaffected
INTERPRETER_MIN_TRITON = (3, 7)

# triton.language, bound by `_triton()` on first use. The kernel below names it only in its body and (thanks to
# postponed annotations) its `tl.constexpr` annotation, both resolved when Triton compiles or interprets it.
tl: Any = None


def _accumulate_kernel(dst, src, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offsets = tl.arange(0, BLOCK)
    full = n // BLOCK
    # Whole blocks without a mask: the compiler can then vectorise the loads and the reductions.
    for block in range(pid, full, programs):
        index = block * BLOCK + offsets
        x = tl.load(src + index).to(dst.dtype.element_ty)
        tl.atomic_add(dst + index, x, sem="relaxed", scope="sys")
    # The ragged tail (possibly empty), by the last program, which has the fewest whole blocks.
    if pid == programs - 1:
        index = full * BLOCK + offsets
        mask = index < n
        x = tl.load(src + index, mask=mask, other=0).to(dst.dtype.element_ty)
        tl.atomic_add(dst + index, x, mask=mask, sem="relaxed", scope="sys")


@functools.cache
def _triton() -> tuple[Any, str | None]:
    """``(triton, None)``, or ``(None, why it cannot be imported)``."""
    global tl
    try:
        import triton
        import triton.language as language
    except ImportError as err:  # torch's CPU wheels come without Triton
        return None, f"Triton is not installed ({err}); it comes with torch's CUDA wheels"
    tl = language
    return triton, None


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The kernel compiled by Triton for GPUs, or run by Triton's interpreter for CPU tensors.

    Built explicitly for each mode: ``triton.jit`` would choose once, at decoration, from ``$TRITON_INTERPRET``.
    """
    triton, why = _triton()
    if triton is None:
        raise RuntimeError(why)
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_accumulate_kernel)
    return triton.jit(_accumulate_kernel)


def _interpreting() -> bool:
    """Triton's own switch for its interpreter (``TRITON_INTERPRET=1``)."""
    triton, _ = _triton()
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is None:  # a Triton older than its knobs module reads the variable itself
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return bool(knobs.runtime.interpret)


def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernel on CPU tensors here (a sentence), or None if it can."""
    triton, why = _triton()
    if triton is None:
        return why
    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if version < INTERPRETER_MIN_TRITON:
        need = ".".join(map(str, INTERPRETER_MIN_TRITON))
        return f"Triton {triton.__version__}'s interpreter cannot run the kernel's loop (Triton {need} or newer can)"
    return None


def kernel_available(device: torch.device | str, dtype: torch.dtype = torch.float32) -> tuple[bool, str]:
    """Whether `accumulate_` can add into ``dtype`` accumulators on ``device``, and a sentence saying why (not).

    Compiles nothing: a CUDA device needs Triton and compute capability 8.0 or newer (9.0 for bf16 accumulators,
    whose vector atomic adds Hopper introduced); CPU tensors need Triton's interpreter (``TRITON_INTERPRET=1``),
    which has no bf16 atomics.

    Args:
        device (`torch.device` or `str`): where the accumulator lives.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): the accumulator's dtype.

    Returns:
        `tuple[bool, str]`: availability and its reason.
    """
    device = torch.device(device)
    if dtype not in ACCUMULATOR_DTYPES:
        return False, f"the kernel adds into fp32 or bf16 accumulators, not {dtype}"
    triton, why = _triton()
    if triton is None:
        return False, why
    if device.type == "cpu":
        if not _interpreting():
            return False, "CPU tensors run the kernel only under Triton's interpreter (TRITON_INTERPRET=1)"
        if dtype == torch.bfloat16:
            return False, "Triton's interpreter has no bf16 atomic adds"
        if (problem := interpreter_problem()) is not None:
            return False, problem
        return True, f"Triton {triton.__version__}'s interpreter on CPU tensors"
    if device.type != "cuda" or torch.version.cuda is None or not torch.cuda.is_available():
        return False, f"the kernel runs on NVIDIA GPUs (CUDA builds of torch), not on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        return False, f"this GPU is sm_{major}{minor}; the kernel needs sm_80 or newer"
    if dtype == torch.bfloat16 and major < 9:
        return False, f"this GPU is sm_{major}{minor}; bf16 atomic adds need sm_90 or newer"
    return True, f"Triton {triton.__version__} on sm_{major}{minor}"


def probe(
    device: torch.device | str, dtype: torch.dtype = torch.float32, src_dtypes: Sequence[torch.dtype] = ()
) -> str | None:
    """Compile and launch the kernel once on a scratch area of ``device``, and check its sum.

    `kernel_available` compiles nothing: a Triton that cannot build the kernel or its launcher (no C compiler, ptxas
    missing, a driver that cannot load the binary) would otherwise fail in the first backward pass. Each source dtype
    is one compiled variant; Triton also specialises on the length's divisibility by 16, so a later call may still
    compile another variant, with the same toolchain that ran here.

    Args:
        device (`torch.device` or `str`): where the accumulators live (CPU tensors run under Triton's interpreter).
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): the accumulators' dtype.
        src_dtypes (`Sequence[torch.dtype]`, *optional*): the dtypes of the sources that will be added; defaults to
            ``dtype``.

    Returns:
        `str | None`: None when every launch ran and summed exactly, else a sentence saying what failed.
    """
    device = torch.device(device)
    for src_dtype in src_dtypes or (dtype,):
        try:
            # Small integers: exact in every source and accumulator dtype, so any difference is a wrong sum.
            src = (torch.arange(PROBE_NUMEL, device=device) % 7 - 3).to(src_dtype)
            dst = torch.zeros(PROBE_NUMEL, dtype=dtype, device=device)
            accumulate_(dst, src, programs=PROBE_PROGRAMS)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # a launch's failure shows here, not later
            exact = torch.equal(dst, src.to(dtype))
        except Exception as err:  # whatever Triton, its compiler or the driver raise: the caller falls back
            lines = str(err).strip().splitlines()
            detail = f"{type(err).__name__}: {lines[0][:300]}" if lines else type(err).__name__
            return f"the accumulate kernel failed its set-up probe ({src_dtype} into {dtype} on {device}): {detail}"
        if not exact:
            return f"the accumulate kernel's set-up probe ({src_dtype} into {dtype} on {device}) summed wrongly"
    return None


def default_sm_share(src_dtype: torch.dtype) -> float:
    """The default share of the SMs for adding a ``src_dtype`` source: `DEFAULT_SM_SHARE` for 4-byte sources,
    `DEFAULT_SM_SHARE_16BIT` for 16-bit ones (each per the sweep their comments cite)."""
    return DEFAULT_SM_SHARE_16BIT if src_dtype.itemsize == 2 else DEFAULT_SM_SHARE


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def max_programs(device: torch.device | str, sm_share: float = DEFAULT_SM_SHARE) -> int:
    """The grid cap: ``sm_share`` of ``device``'s SMs, at least one program (`INTERPRETER_PROGRAMS` on CPU).

    Raises:
        ValueError: ``sm_share`` is not in (0, 1].
    """
    if isinstance(sm_share, bool) or not isinstance(sm_share, int | float) or not 0 < sm_share <= 1:
        raise ValueError(f"sm_share must be in (0, 1], got {sm_share!r}")
    device = torch.device(device)
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, math.floor(_sm_count(index) * sm_share))


def accumulate_(dst: torch.Tensor, src: torch.Tensor, *, programs: int | None = None) -> torch.Tensor:
    """``dst += src`` with system-scope atomic adds, the cast from ``src``'s dtype done in registers.

    Safe against concurrent adds into ``dst`` from other processes and GPUs (relaxed atomics: the sum is exact up to
    the order of floating-point additions). Enqueued on the current stream; returns ``dst``. Every precondition is
    checked before anything is launched: the kernel itself reads and writes raw pointers, unchecked.

    Args:
        dst (`torch.Tensor`): 1-D contiguous accumulator, fp32 or bf16 (possibly a peer's mapped memory), on a CUDA
            device (or on CPU, run by Triton's interpreter).
        src (`torch.Tensor`): as many elements as ``dst`` (any shape, contiguous), fp32, bf16 or fp16, on the same
            device, and not overlapping ``dst`` in memory.
        programs (`int`, *optional*): grid cap, at least 1; defaults to `max_programs` of ``dst``'s device at
            `default_sm_share` of ``src``'s dtype.

    Raises:
        TypeError: a dtype the kernel does not handle, or a grid cap that is not an `int`.
        ValueError: shapes, layouts, devices or memory that do not fit the kernel, or a grid cap below 1.
        RuntimeError: ``torch.use_deterministic_algorithms(True)`` is on (atomic adds sum in varying order), or
            Triton is not installed.
    """
    if dst.dtype not in ACCUMULATOR_DTYPES:
        raise TypeError(f"accumulate_ adds into fp32 or bf16, got a {dst.dtype} accumulator")
    if src.dtype not in SOURCE_DTYPES:
        raise TypeError(f"accumulate_ reads fp32, bf16 or fp16 sources, got {src.dtype}")
    if dst.dim() != 1 or not dst.is_contiguous():
        raise ValueError(
            f"accumulate_ needs a 1-D contiguous accumulator, got shape {tuple(dst.shape)} and strides {dst.stride()}"
        )
    if src.numel() != dst.numel():
        raise ValueError(f"accumulate_ of {src.numel()} elements into an accumulator of {dst.numel()}")
    if not src.is_contiguous():
        raise ValueError("accumulate_ needs a contiguous source (it reads it in place, without staging)")
    if src.device != dst.device:
        raise ValueError(f"accumulate_ from {src.device} into {dst.device}: both must be on one device")
    if dst.device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"accumulate_ runs on CUDA tensors (CPU tensors under Triton's interpreter), got {dst.device.type} tensors"
        )
    # The kernel reads src while other programs write dst: overlapping memory would read partly summed values.
    n = dst.numel()
    if n and dst.data_ptr() < src.data_ptr() + src.nbytes and src.data_ptr() < dst.data_ptr() + dst.nbytes:
        raise ValueError("accumulate_ reads src while it adds into dst: the two must not overlap in memory")
    if programs is not None:
        if isinstance(programs, bool) or not isinstance(programs, int):
            raise TypeError(f"programs must be an int, got {type(programs).__name__}")
        if programs < 1:
            raise ValueError(f"programs must be >= 1, got {programs}")
    if torch.are_deterministic_algorithms_enabled():
        raise RuntimeError(
            "accumulate_ adds with atomics, whose order varies from run to run, but "
            "torch.use_deterministic_algorithms(True) is on"
        )
    if n == 0:
        return dst
    interpret = dst.device.type != "cuda"
    kernel = _kernel(interpret)
    cap = programs if programs is not None else max_programs(dst.device, default_sm_share(src.dtype))
    src = src.reshape(-1)
    for start in range(0, n, MAX_LAUNCH_NUMEL):
        stop = min(start + MAX_LAUNCH_NUMEL, n)
        grid = (min(cap, -(-(stop - start) // BLOCK)),)
        if interpret:
            kernel[grid](dst[start:stop], src[start:stop], stop - start, BLOCK=BLOCK)
        else:
            # Triton launches on the current device; dst may be a peer's memory mapped on this one. Nothing to fuse
            # (a convert and an add): said explicitly, which also keeps Triton's warning about its default quiet.
            with torch.cuda.device(dst.device):
                kernel[grid](
                    dst[start:stop],
                    src[start:stop],
                    stop - start,
                    BLOCK=BLOCK,
                    num_warps=NUM_WARPS,
                    enable_fp_fusion=False,
                )
    return dst
