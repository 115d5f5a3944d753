"""What every benchmark records about the machine and dtype it ran on, so that
numbers from an AVX2 machine and from an AVX-512 one are never confused."""

from __future__ import annotations

import argparse

import torch

from worker.platform import DTYPE_CHOICES, current_platform, dtype_name


def add_dtype_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtype", default="auto", type=str.lower, choices=DTYPE_CHOICES,
                    help="the serving dtype (auto: what `kervan info` says auto stands for here)")


def machine(dtype: str | None = None) -> dict:
    """The ISA level, cores and torch build; with ``dtype``, what it resolved to here."""
    platform = current_platform()
    cpu = platform.cpu
    out = {"cpu": cpu.model, "isa": cpu.isa, "torch_capability": cpu.torch_capability,
           "native_bf16": cpu.has_native_bf16, "cores": cpu.num_cores, "torch": torch.__version__}
    if dtype is not None:
        out.update(dtype_requested=dtype, dtype=dtype_name(platform.resolve_dtype(dtype, "cpu")))
    return out
