"""What every benchmark records about the machine and dtype it ran on, so that
numbers from an AVX2 machine and from an AVX-512 one are never confused."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import torch

from kervan import envs
from worker.platform import DTYPE_CHOICES, current_platform, dtype_name

ROOT = Path(__file__).resolve().parent.parent  # the checkout a report stamps
MKL_CAP = "MKL_ENABLE_INSTRUCTIONS"  # AVX2 caps MKL as ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA cap the rest


def add_dtype_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtype", default="auto", type=str.lower, choices=DTYPE_CHOICES,
                    help="the serving dtype (auto: what `kervan info` says auto stands for here)")


def machine(dtype: str | None = None) -> dict:
    """The ISA level, cores and torch build; with ``dtype``, what it resolved to here."""
    platform = current_platform()
    cpu = platform.cpu
    out = {"cpu": cpu.model, "isa": cpu.isa, "torch_capability": cpu.torch_capability,
           "native_bf16": cpu.has_native_bf16, "amx": cpu.has_amx, "cores": cpu.num_cores, "torch": torch.__version__}
    if os.environ.get(MKL_CAP):  # PyTorch's and oneDNN's caps leave MKL's float32 GEMMs on the CPU's best
        out["mkl_cap"] = os.environ[MKL_CAP]
    if dtype is not None:
        out.update(dtype_requested=dtype, dtype=dtype_name(platform.resolve_dtype(dtype, "cpu")))
    return out


def commit(root: Path = ROOT) -> str:
    """The checkout's commit, ``-dirty`` when it has uncommitted changes (``unknown`` outside git);
    the reports under ``benchmarks/results/`` aside, which a series of runs writes one after another."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def uncommitted(root: Path = ROOT) -> str:
    """What a ``-dirty`` checkout changed against its commit, as ``git diff`` prints it (the
    reports under ``benchmarks/results/`` aside): stored in its report, so a reader can tell what
    code was measured."""
    return subprocess.run(["git", "diff", "HEAD", "--", ".", ":(exclude)benchmarks/results"], cwd=root,
                          capture_output=True, text=True, check=True).stdout


# the environment variables that change what the engine computes or how (never a key or secret)
ENGINE_SWITCHES = (envs.KERVAN_ATTENTION_BACKEND, envs.KERVAN_DECODE_STACK, envs.KERVAN_HEAP,
                   envs.KERVAN_QUANT_ACTIVATIONS, envs.KERVAN_WEIGHT_PACKING)


def write_report(report: dict, path: str | None, args: argparse.Namespace | None = None, root: Path = ROOT) -> None:
    """Print the report; with ``path``, also write it there with the commit it measured (and the
    diff of a dirty checkout, and, with ``args``, the arguments it ran with)."""
    report = {**report, "commit": commit(root)}
    if report["commit"].endswith("-dirty"):
        report["diff"] = uncommitted(root)
    settings = {k: os.environ[k] for k in ENGINE_SWITCHES if k in os.environ}
    if settings:  # the engine's own switches this run was measured under
        report.setdefault("environment", settings)
    if args is not None:
        report.setdefault("arguments", vars(args))
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
