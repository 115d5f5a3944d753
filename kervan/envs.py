"""Every environment variable Kervan reads, in one place.

Besides those below, each service option ``--some-option`` of service NAME
(worker, router, scheduler, kv_registry) reads ``KERVAN_<NAME>_<SOME_OPTION>``
when the flag is not given; the rule lives in ``services/common/config.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path


def _one_of(name: str, choices: tuple[str, ...]) -> str:
    """The variable's value, one of ``choices`` (unset: the first)."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        raise ValueError(f"{name}={value!r}; expected {', '.join(choices[:-1])} or {choices[-1]}")
    return value


# where the embedded default model (and later other artefacts) are written
KERVAN_CACHE_DIR = "KERVAN_CACHE_DIR"


def cache_dir() -> Path:
    return Path(os.environ.get(KERVAN_CACHE_DIR) or Path.home() / ".cache" / "kervan")

# "auto" (the native CPU kernels, attention and fused element-wise ops, when they
# build; else PyTorch), "native" (fail if they cannot build) or "torch" (always PyTorch)
KERVAN_ATTENTION_BACKEND = "KERVAN_ATTENTION_BACKEND"


def attention_backend() -> str:
    return _one_of(KERVAN_ATTENTION_BACKEND, ("auto", "native", "torch"))

# seconds a start waits for another process building the native kernels before it
# uses the PyTorch path instead
KERVAN_KERNEL_BUILD_WAIT_S = "KERVAN_KERNEL_BUILD_WAIT_S"


def kernel_build_wait_s() -> float:
    return float(os.environ.get(KERVAN_KERNEL_BUILD_WAIT_S, "120"))

# seconds a worker group's ranks may wait in a collective while no other rank works (beats
# and is not waiting itself) before they take the group for broken: a rank that dies or hangs
# takes the whole group down, a slow one is waited for
KERVAN_GROUP_TIMEOUT_S = "KERVAN_GROUP_TIMEOUT_S"


def group_timeout_s() -> float:
    return float(os.environ.get(KERVAN_GROUP_TIMEOUT_S, "30"))


# a worker group whose ranks 1..N-1 run on other hosts: a JSON list, per peer rank, of the argv prefix that
# starts a process on its host (the simulated hosts' ``nsenter``); the ranks then talk over gloo on
# ``GLOO_SOCKET_IFNAME`` (the hosts' interface), never through shared memory
KERVAN_GROUP_PEER_HOSTS = "KERVAN_GROUP_PEER_HOSTS"


def group_peer_hosts() -> list[list[str]] | None:
    text = os.environ.get(KERVAN_GROUP_PEER_HOSTS)
    if not text:
        return None
    prefixes = json.loads(text)
    if not isinstance(prefixes, list) or not all(isinstance(p, list) and all(isinstance(a, str) for a in p)
                                                 for p in prefixes):
        raise ValueError(f"{KERVAN_GROUP_PEER_HOSTS} must be a JSON list of argv lists, got {text!r}")
    return prefixes


# "auto" (pack linear weights where the platform says it pays: oneDNN's micro-kernel layout where it packs
# the dtype, else oneDNN's linear layout), "onednn" (oneDNN's linear layout only) or "off"
KERVAN_WEIGHT_PACKING = "KERVAN_WEIGHT_PACKING"


def weight_packing() -> str:
    return _one_of(KERVAN_WEIGHT_PACKING, ("auto", "onednn", "off"))


# the kernel of quantized matmuls with integer codes, for every call: "float" (x as it comes, codes decoded
# in registers), "int8" (x quantized to int8 by blocks of 32, llama.cpp's path), "int8x2" (x to two int8
# terms, its own and its remainder's) or "auto" (worker/quant/kernel_choice.py's DEFAULT_KERNEL)
KERVAN_QUANT_ACTIVATIONS = "KERVAN_QUANT_ACTIVATIONS"
QUANT_ACTIVATIONS = ("auto", "float", "int8", "int8x2")


def quant_activations() -> str:
    return _one_of(KERVAN_QUANT_ACTIVATIONS, QUANT_ACTIVATIONS)

# decode steps through the native decode stack ("auto": wherever it applies, worker/models/decode_stack.py)
# or the model's Python modules ("off": the reference path, and the baseline its benchmark compares with)
KERVAN_DECODE_STACK = "KERVAN_DECODE_STACK"


def decode_stack() -> str:
    return _one_of(KERVAN_DECODE_STACK, ("auto", "off"))

# the C heap of a process serving on the CPU: "keep" (freed memory reused by the next step, as
# tcmalloc does; worker/kv/memory.py) or "system" (glibc's defaults)
KERVAN_HEAP = "KERVAN_HEAP"


def heap() -> str:
    return _one_of(KERVAN_HEAP, ("keep", "system"))


# standard variables Kervan honours: oneDNN's ISA cap (PyTorch's own,
# ATEN_CPU_CAPABILITY, is read back through torch.backends.cpu.get_cpu_capability())
# and the C++ compiler the native kernels are built with
ONEDNN_MAX_CPU_ISA = "ONEDNN_MAX_CPU_ISA"
CXX = "CXX"


def onednn_max_cpu_isa() -> str:
    return os.environ.get(ONEDNN_MAX_CPU_ISA, os.environ.get("DNNL_MAX_CPU_ISA", ""))


def cxx() -> str:
    return os.environ.get(CXX, "c++")

# "1": no progress bars on the terminal, only a line as each long wait ends (kervan/progress.py)
KERVAN_QUIET = "KERVAN_QUIET"


def quiet() -> bool:
    return os.environ.get(KERVAN_QUIET, "") not in ("", "0")

# the services' log level (DEBUG shows, e.g., every placement with its scores)
KERVAN_LOG_LEVEL = "KERVAN_LOG_LEVEL"


def log_level() -> str:
    return os.environ.get(KERVAN_LOG_LEVEL, "INFO").upper()

# set by the launcher, read by the services: the file descriptor of a pipe whose write end the
# launcher holds; a child sees it close when the launcher dies, and exits (services/common/lifeline.py)
KERVAN_LIFELINE_FD = "KERVAN_LIFELINE_FD"
# set by the launcher ("1"), read by the services: bind the listening port with SO_REUSEPORT, beside the
# launcher's own non-listening socket on it, which keeps other users off the port across restarts
# (control_plane/cli/port_reservations.py); unset, a second process cannot bind a port a live one holds
KERVAN_LISTEN_REUSEPORT = "KERVAN_LISTEN_REUSEPORT"


def listen_reuseport() -> bool:
    return os.environ.get(KERVAN_LISTEN_REUSEPORT) == "1"

# the shared secret of a plaintext mesh, in the environment, never on a command line
# (services/common/security.py); ``kervan up`` makes one when the public API has keys
KERVAN_MESH_SECRET = "KERVAN_MESH_SECRET"
# the client side of the command line (``kervan generate``, ``kervan bench``): the router's CA
# (connect with TLS) and an API key for a router that requires one
KERVAN_TLS_CA = "KERVAN_TLS_CA"
KERVAN_API_KEY = "KERVAN_API_KEY"

# the disk tier's MAC key (64 hex digits: 32 bytes), for deploys that keep it in a secret; unset: a key
# made once in KERVAN_CACHE_DIR/keys/ (never in the tier's own directory, whose files it vouches for)
KERVAN_KV_DISK_KEY = "KERVAN_KV_DISK_KEY"


def kv_disk_key() -> bytes | None:
    value = os.environ.get(KERVAN_KV_DISK_KEY)
    if value is None:
        return None
    try:
        key = bytes.fromhex(value.strip())
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ValueError(f"{KERVAN_KV_DISK_KEY} must be 64 hex digits (32 bytes)")
    return key
