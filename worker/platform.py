"""The one module that knows the hardware: the device (CUDA or the CPU), the CPU's
instruction sets and its cores. Every other module asks it; none reads
``/proc/cpuinfo`` or PyTorch's capability itself.

The answer honours the standard caps, so that one machine can be made to take
another's path: PyTorch's ``ATEN_CPU_CAPABILITY`` (read back through
``torch.backends.cpu.get_cpu_capability()``) and oneDNN's ``ONEDNN_MAX_CPU_ISA``.
The CPU's own flags are not enough on their own: PyTorch's bf16 packing check
reads them and ignores both caps, so every decision here reads the capped level.

Decisions made here: the dtype ``auto`` stands for (bf16 where the hardware
computes it natively, float32 on other CPUs, float16 on GPUs without bf16), which
dtypes are worth packing for oneDNN, and the ISA level native kernels are built for."""

from __future__ import annotations

import functools
import logging
import os
import platform as _platform
from dataclasses import dataclass

import torch

from kervan.engine_args import DTYPE_CHOICES
from kervan.envs import onednn_max_cpu_isa

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16, "float32": torch.float32, "fp32": torch.float32,
          "float": torch.float32}

# x86 levels, lowest first: what PyTorch dispatches to and what native kernels are built for
X86_LEVELS = ("baseline", "avx2", "avx512")
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})  # PyTorch's AVX512 and oneDNN's bf16 packing
_TORCH_LEVELS = {"DEFAULT": "baseline", "AVX2": "avx2", "AVX512": "avx512"}


class DtypeError(ValueError):
    """A dtype name Kervan does not know."""


def parse_dtype(value: str | torch.dtype) -> str | torch.dtype:
    """``"auto"`` or a torch dtype; anything else is refused naming the allowed values."""
    if isinstance(value, torch.dtype):
        if value not in DTYPES.values():
            raise DtypeError(f"dtype {value} is not supported; choose one of {', '.join(DTYPE_CHOICES)}")
        return value
    name = str(value).lower().removeprefix("torch.")
    if name == "auto":
        return "auto"
    if name not in DTYPES:
        raise DtypeError(f"dtype {value!r} unknown; choose one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _onednn_level(cap: str) -> str | None:
    """The x86 level oneDNN's ``ONEDNN_MAX_CPU_ISA`` allows; None when it caps nothing."""
    cap = cap.upper()
    if cap in ("", "ALL", "DEFAULT"):
        return None
    if cap.startswith(("AVX512", "AVX10")):
        return "avx512"
    if cap.startswith("AVX2"):
        return "avx2"
    return "baseline"  # SSE41, AVX


def _onednn_allows(cap: str, *markers: str) -> bool:
    """Whether the oneDNN cap leaves an ISA extension on (bf16 or AMX instructions)."""
    cap = cap.upper()
    return cap in ("", "ALL", "DEFAULT") or cap.startswith("AVX10") or any(m in cap for m in markers)


@dataclass(frozen=True, kw_only=True)
class CpuInfo:
    arch: str  # platform.machine(): x86_64, aarch64, ...
    model: str  # the CPU's model name, "" when unknown
    num_cores: int  # cores this process may run on (its affinity mask)
    flags: frozenset[str]  # the CPU's own feature flags, before any cap
    torch_capability: str  # what PyTorch dispatches to, after ATEN_CPU_CAPABILITY
    onednn_cap: str = ""  # ONEDNN_MAX_CPU_ISA, "" when unset

    @property
    def is_x86(self) -> bool:
        return self.arch in ("x86_64", "amd64", "AMD64", "i686", "i386")

    @property
    def isa(self) -> str:
        """The capped instruction-set level: baseline/avx2/avx512 on x86, sve/neon/baseline on ARM."""
        if not self.is_x86:
            if "sve" in self.flags and self.torch_capability.startswith("SVE"):
                return "sve"
            return "neon" if "asimd" in self.flags else "baseline"
        hw = self.x86_hardware_level
        caps = [hw, _TORCH_LEVELS.get(self.torch_capability, hw), _onednn_level(self.onednn_cap) or hw]
        return min(caps, key=X86_LEVELS.index)

    @property
    def x86_hardware_level(self) -> str:
        """The x86 level the CPU itself has, before any cap: baseline, avx2 or avx512."""
        return "avx512" if _AVX512 <= self.flags else "avx2" if {"avx2", "fma"} <= self.flags else "baseline"

    @property
    def has_amx(self) -> bool:
        return (self.isa == "avx512" and {"amx_tile", "amx_bf16"} <= self.flags
                and _onednn_allows(self.onednn_cap, "AMX"))

    @property
    def has_native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16, AMX, ARM BF16), not capped away."""
        if not self.is_x86:
            return "bf16" in self.flags
        return (self.isa == "avx512" and bool({"avx512_bf16", "amx_bf16"} & self.flags)
                and _onednn_allows(self.onednn_cap, "BF16", "AMX", "FP16"))

    @property
    def has_native_fp16(self) -> bool:
        if not self.is_x86:
            return "asimdhp" in self.flags
        return (self.isa == "avx512" and bool({"avx512_fp16", "amx_fp16"} & self.flags)
                and _onednn_allows(self.onednn_cap, "FP16"))

    def can_pack(self, dtype: torch.dtype) -> bool:
        """Whether oneDNN's packed linear weights are both accepted and faster here
        (``benchmarks/linear_packing.py``: float32 1.1-2.9x at decode shapes on AVX2, bf16
        up to 2x at one row on AVX-512 with bf16). oneDNN packs bf16 only with AVX-512
        (BW/VL/DQ) or AVX-NE-CONVERT; ARM keeps plain weights (not measured there)."""
        if not self.is_x86 or self.isa == "baseline":
            return False
        if dtype == torch.float32:
            return True
        if dtype == torch.bfloat16:
            return self.isa == "avx512" or ("avx_ne_convert" in self.flags and self.onednn_cap == "")
        return False


@dataclass(frozen=True, kw_only=True)
class CudaInfo:
    name: str
    capability: tuple[int, int]
    count: int

    @property
    def has_bf16(self) -> bool:
        return self.capability >= (8, 0)  # Ampere and later


@dataclass(frozen=True, kw_only=True)
class Platform:
    cpu: CpuInfo
    cuda: CudaInfo | None = None

    @property
    def device(self) -> str:
        """The device ``auto`` stands for."""
        return "cuda" if self.cuda is not None else "cpu"

    def resolve_device(self, requested: str) -> str:
        return self.device if requested == "auto" else requested

    def num_ranks(self, device: str) -> int:
        """How many ranks of a worker group this machine runs: one per usable core on
        the CPU, one per GPU on CUDA."""
        return torch.cuda.device_count() if device.startswith("cuda") else len(usable_cores())

    def auto_dtype(self, device: str) -> torch.dtype:
        if device.startswith("cuda"):
            return torch.bfloat16 if self.cuda is None or self.cuda.has_bf16 else torch.float16
        return torch.bfloat16 if self.cpu.has_native_bf16 else torch.float32

    def resolve_dtype(self, requested: str | torch.dtype, device: str) -> torch.dtype:
        """The dtype to serve in; an explicit one this hardware runs slowly is kept,
        with one warning that says what would be faster."""
        parsed = parse_dtype(requested)
        best = self.auto_dtype(device)
        if isinstance(parsed, str):  # "auto"
            return best
        requested = parsed
        slow = self.slowness(requested, device)
        if slow:
            log.warning("dtype %s %s; %s is faster here (dtype=auto picks it)", dtype_name(requested), slow,
                        dtype_name(best))
        return requested

    def slowness(self, dtype: torch.dtype, device: str) -> str | None:
        """Why ``dtype`` runs slowly on ``device``, or None when it does not."""
        if device.startswith("cuda"):
            if dtype == torch.float32:
                return "keeps the GPU's tensor cores mostly idle"
            if dtype == torch.bfloat16 and self.cuda is not None and not self.cuda.has_bf16:
                return f"is emulated on {self.cuda.name} (compute capability {self.cuda.capability})"
            return None
        if dtype == torch.bfloat16 and not self.cpu.has_native_bf16:
            return f"is emulated on this CPU (ISA {self.cpu.isa}, no native bf16)"
        if dtype == torch.float16 and not self.cpu.has_native_fp16:
            return f"is emulated on this CPU (ISA {self.cpu.isa}, no native fp16)"
        if dtype == torch.float32 and self.cpu.has_native_bf16:
            return "moves twice the bytes of bfloat16, which this CPU computes natively"
        return None

    def can_pack(self, dtype: torch.dtype, device: str) -> bool:
        return (device == "cpu" and self.cpu.can_pack(dtype) and torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))

    def describe(self) -> dict:
        """What ``kervan info`` prints and a worker logs at start."""
        cpu = self.cpu
        interesting = sorted(f for f in cpu.flags if f.startswith(("avx", "amx", "fma", "sve", "asimd", "bf16")))
        return {
            "torch": torch.__version__,
            "device": self.device,
            "cuda": None if self.cuda is None else {"name": self.cuda.name, "capability": list(self.cuda.capability),
                                                   "count": self.cuda.count, "bf16": self.cuda.has_bf16},
            "cpu": {"model": cpu.model, "arch": cpu.arch, "cores": cpu.num_cores, "isa": cpu.isa,
                    "torch_capability": cpu.torch_capability, "onednn_max_cpu_isa": cpu.onednn_cap or None,
                    "native_bf16": cpu.has_native_bf16, "amx": cpu.has_amx, "flags": interesting},
            "dtype_auto": dtype_name(self.auto_dtype(self.device)),
            "packed_dtypes": [dtype_name(d) for d in (torch.float32, torch.bfloat16) if self.can_pack(d, "cpu")],
        }

    def summary(self) -> str:
        """One line for a log."""
        d = self.describe()
        cpu = d["cpu"]
        where = f"cuda {d['cuda']['name']}" if d["cuda"] else "cpu"
        return (f"{where}; {cpu['model'] or cpu['arch']}: isa {cpu['isa']} (torch {cpu['torch_capability']}"
                f"{', oneDNN cap ' + cpu['onednn_max_cpu_isa'] if cpu['onednn_max_cpu_isa'] else ''}), "
                f"native bf16 {'yes' if cpu['native_bf16'] else 'no'}, {cpu['cores']} cores; "
                f"dtype auto = {d['dtype_auto']}; packed linears: {', '.join(d['packed_dtypes']) or 'none'}")


def read_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """(model name, feature flags) of the first processor listed; empty where unreadable."""
    model, flags = "", frozenset[str]()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model") and not model:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags


def usable_cores() -> list[int]:
    """The ids of the cores this process may run on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def detect_cpu() -> CpuInfo:
    model, flags = read_cpuinfo()
    return CpuInfo(arch=_platform.machine(), model=model, num_cores=len(usable_cores()), flags=flags,
                   torch_capability=torch.backends.cpu.get_cpu_capability(),
                   onednn_cap=onednn_max_cpu_isa())


def detect_cuda() -> CudaInfo | None:
    if not torch.cuda.is_available():
        return None
    return CudaInfo(name=torch.cuda.get_device_name(0), capability=torch.cuda.get_device_capability(0),
                    count=torch.cuda.device_count())


@functools.cache
def current_platform() -> Platform:
    return Platform(cpu=detect_cpu(), cuda=detect_cuda())
