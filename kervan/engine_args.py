"""The engine's options, written once: ``EngineArgs`` (vLLM's ``EngineArgs``).

Each field is one option with its type, default and help. Every surface is made from these
fields, so adding an option is one field here:

- the worker's flags (``python -m services.worker``): ``add_arguments`` / ``from_namespace``;
- ``kervan up``'s and ``kervan complete``'s options (``control_plane/cli/engine_options.py``);
- the local launcher's record of a cluster (``ClusterSpec.engine``) and the worker command
  lines it writes: ``to_flags``;
- the engine itself: ``worker.config.EngineConfig`` is this record plus what needs torch
  (the dtype resolved, the quantization method looked up, sizes fitted to the model).

Torch-free, like the rest of ``kervan``: the launcher and ``kervan up --help`` read it without
loading torch. The checks here are the ones that need nothing but the values (a count below
1, a choice outside its list, two options that need each other)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kervan.block_hash import DEFAULT_BLOCK_SIZE
from kervan.speculative import SPECULATIVE_METHODS

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")  # what help texts and errors offer
KV_DISK_WRITES = ("back", "through")


class EngineArgsError(ValueError):
    """An option's value the engine cannot take, named as the field is."""


def option(default: Any, help: str, *, flags: tuple[str, ...] = (), choices: tuple[str, ...] = (),
           metavar: str | None = None, existing_dir: bool = False) -> Any:
    """A field of ``EngineArgs``: ``flags`` are its command-line names (default ``--field-name``;
    the first is the one written), ``choices`` what a string option takes, ``existing_dir``: a
    directory that must exist where the command is given (checked there, before anything starts)."""
    return field(default=default, metadata={"help": help, "flags": flags, "choices": choices, "metavar": metavar,
                                            "existing_dir": existing_dir})


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    dtype: str = option("auto", "auto (bfloat16 where the hardware computes it natively, else float32; float16 "
                        "on GPUs without bf16), bfloat16, float16 or float32; `kervan info` shows the choice",
                        choices=DTYPE_CHOICES)
    device: str = option("auto", "auto (CUDA when present), cpu, cuda or cuda:N")
    block_size: int = option(DEFAULT_BLOCK_SIZE, "tokens per KV block; every process of a mesh takes the same "
                             "(the kv-registry refuses others)")
    num_kv_blocks: int | None = option(None, "KV blocks in the pool (default: as many as --kv-cache-memory-bytes "
                                       "holds)")
    kv_cache_memory_bytes: int = option(512 * 1024 * 1024, "bytes for K and V of all layers, when "
                                        "--num-kv-blocks is not given")
    kv_host_bytes: int = option(0, "host memory behind the KV pool (worker/kv/host_tier.py): blocks leaving it "
                                "(evicted prefixes, preempted sequences) are kept there and copied back on a hit "
                                "instead of computed (0: none)")
    kv_disk_dir: str | None = option(None, "directory of the disk tier behind the host tier (one file, "
                                     "kv-blocks.bin; its blocks are found again after a restart; kervan up gives "
                                     "each worker a subdirectory named after it)")
    kv_disk_bytes: int = option(0, "size of the disk tier's file, reserved at start (0: no disk tier; needs "
                                "--kv-disk-dir and --kv-host-bytes)")
    kv_disk_write: str = option("back", "back: a block is written to disk when the host tier lets it go; "
                                "through: as soon as it leaves the pool (more writes; it survives the host "
                                "tier's loss at once)", choices=KV_DISK_WRITES)
    kv_offload_min_uses: int = option(1, "the tiers' reuse gate: a block is demoted to host memory (and disk) "
                                      "only once this many requests used it (1: every block; 2 keeps one-off "
                                      "prompts from flushing the tiers)")
    max_num_batched_tokens: int = option(2048, "tokens one engine step computes at most: a longer prompt is "
                                         "prefilled in chunks of this size between decode steps (chunked "
                                         "prefill; smaller: steadier inter-token latency)")
    long_prefill_token_threshold: int = option(0, "prompt tokens one sequence computes per step at most, so a "
                                               "long prompt leaves budget for new streams' prompts (0: only the "
                                               "step's budget bounds it)")
    max_num_seqs: int = option(64, "sequences one engine step runs at most")
    max_model_len: int | None = option(None, "prompt plus output tokens a request may take (default: the "
                                       "model's max_position_embeddings, cut to what the KV cache holds)")
    enable_prefix_caching: bool = option(True, "reuse the KV of a prompt's cached prefix (blocks by chained "
                                         "hash)")
    max_n: int = option(16, "the most samples one request may ask for (n)")
    seed: int = option(0, "the seed of requests that give none")
    # a worker group (``worker/parallel/``): the mesh sees one worker of several ranks
    tensor_parallel_size: int = option(1, "a worker group of N ranks each holding 1/N of every layer",
                                       flags=("--tensor-parallel", "--tensor-parallel-size"))
    expert_parallel_size: int = option(1, "ranks each holding 1/N of the experts, tokens sent to them "
                                       "(all-to-all); equal to --tensor-parallel, or that 1",
                                       flags=("--expert-parallel", "--expert-parallel-size"))
    pipeline_parallel_size: int = option(1, "pipeline stages each holding 1/N of the layers",
                                         flags=("--pipeline-parallel", "--pipeline-parallel-size"))
    enforce_eager: bool = option(False, "CUDA: run decode steps eagerly instead of replaying CUDA graphs "
                                 "captured at start (worker/runner/graphs.py)")
    deterministic: bool = option(False, "refuse to start unless a request's greedy tokens and logprobs are "
                                 "bit-identical whatever else it is batched with, however its prompt is chunked, "
                                 "wherever its prefix KV came from (the CPU's default with the native kernels; "
                                 "no batch-invariant GPU kernels yet)")
    quantization: str | None = option(None, "weight-only low precision for a float checkpoint: int8, int4 "
                                      "(groups of 64; int4-g32, int4-g128), fp8, fp8-block, nvfp4; a GGUF model "
                                      "is served in its own blocks without it", metavar="METHOD")
    # speculative decoding (``worker/spec/``): a prefill-only worker emits one token and never speculates
    speculative: str | None = option(None, "guess the next tokens and verify them in one step: ngram (prompt "
                                     "lookup, no weights), draft (a smaller model with the same tokenizer, "
                                     "--speculative-model) or eagle (the head Kervan ships for a catalog model, "
                                     "or --speculative-model); the output stays the model's own",
                                     choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = option(3, "guesses per sequence and step")
    speculative_model: str | None = option(None, "the draft model's directory, or the EAGLE head's",
                                           existing_dir=True)
    prompt_lookup_min: int = option(2, "ngram: the fewest tokens a match takes")
    prompt_lookup_max: int = option(4, "ngram: the most tokens a match takes (longest first)")
    # 2: on SmolLM2-135M in bf16 both proposers gain at batch 2 and lose from batch 4 on chat
    # answers (``benchmarks/speculative.py``)
    speculative_disable_by_batch_size: int = option(2, "no guesses in a step whose batch holds more sequences "
                                                    "than this (0: always guess)")

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_n", "tensor_parallel_size",
                     "expert_parallel_size", "pipeline_parallel_size", "kv_offload_min_uses"):
            _at_least(name, getattr(self, name), 1)
        for name in ("kv_host_bytes", "kv_disk_bytes", "long_prefill_token_threshold", "kv_cache_memory_bytes"):
            _at_least(name, getattr(self, name), 0)
        if self.num_kv_blocks is not None:
            _at_least("num_kv_blocks", self.num_kv_blocks, 2)
        if self.max_model_len is not None:
            _at_least("max_model_len", self.max_model_len, 1)
        if isinstance(self.dtype, str) and self.dtype.lower() not in DTYPE_CHOICES:
            raise EngineArgsError(f"dtype {self.dtype!r} unknown; choose one of {', '.join(DTYPE_CHOICES)}")
        if self.kv_disk_write not in KV_DISK_WRITES:
            raise EngineArgsError(f"kv_disk_write must be back or through, got {self.kv_disk_write!r}")
        if self.kv_disk_bytes and not (self.kv_disk_dir and self.kv_host_bytes):
            raise EngineArgsError("kv_disk_bytes needs kv_disk_dir and kv_host_bytes (the disk tier is one file "
                                  "in that directory, behind the host tier)")
        self._check_speculative()

    def _check_speculative(self) -> None:
        if self.speculative not in (None, *SPECULATIVE_METHODS):
            raise EngineArgsError(f"speculative {self.speculative!r} unknown; choose one of "
                                  f"{', '.join(SPECULATIVE_METHODS)}")
        _at_least("speculative_disable_by_batch_size", self.speculative_disable_by_batch_size, 0)
        if self.speculative is None:
            return
        _at_least("num_speculative_tokens", self.num_speculative_tokens, 1)
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise EngineArgsError(f"n-gram sizes need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                  f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.speculative == "draft" and self.speculative_model is None:
            raise EngineArgsError("speculative='draft' needs speculative_model, the draft model's directory")
        if self.speculative == "ngram" and self.speculative_model is not None:
            raise EngineArgsError("speculative='ngram' takes no speculative_model (it has no weights)")

    @property
    def world_size(self) -> int:
        """Ranks of the worker group (1: one process)."""
        return max(self.tensor_parallel_size, self.expert_parallel_size) * self.pipeline_parallel_size

    def without_speculation(self) -> EngineArgs:
        """These options for a prefill-only worker, which never speculates."""
        unset: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(self)
                                 if f.name.startswith(SPECULATION_FIELDS)}
        return dataclasses.replace(self, **unset)


SPECULATION_FIELDS = ("speculative", "num_speculative_tokens", "prompt_lookup_")


def _at_least(name: str, value: int, least: int) -> None:
    if value < least:
        raise EngineArgsError(f"{name} must be >= {least}, got {value}")


@dataclass(frozen=True)
class Option:
    """One field as a command line takes it."""

    name: str
    flags: tuple[str, ...]
    kind: type  # int, float, str or bool
    optional: bool  # None is a value (the default: unset)
    default: Any
    help: str
    choices: tuple[str, ...]
    metavar: str | None
    existing_dir: bool = False


def options(cls: type[EngineArgs] = EngineArgs) -> list[Option]:
    """``cls``'s fields as command-line options, in their order."""
    kinds = {"int": int, "float": float, "str": str, "bool": bool}
    out = []
    for f in dataclasses.fields(cls):
        type_name = str(f.type).replace(" ", "")
        optional = type_name.endswith("|None")
        kind = kinds.get(type_name.removesuffix("|None"), str)  # EngineConfig's dtype: a torch dtype or its name
        flags = f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)
        out.append(Option(f.name, flags, kind, optional, f.default, f.metadata.get("help", ""),
                          f.metadata.get("choices", ()), f.metadata.get("metavar"),
                          f.metadata.get("existing_dir", False)))
    return out


def add_arguments(parser: argparse.ArgumentParser, cls: type[EngineArgs] = EngineArgs) -> None:
    """``cls``'s fields as ``parser``'s flags (a group of their own)."""
    group = parser.add_argument_group("engine", "the engine's options (kervan/engine_args.py); kervan up takes "
                                      "the same")
    for o in options(cls):
        if o.kind is bool:
            group.add_argument(*o.flags, dest=o.name, action=argparse.BooleanOptionalAction, default=o.default,
                               help=o.help)
            continue
        kind: Any = str.lower if o.name == "dtype" else o.kind
        group.add_argument(*o.flags, dest=o.name, type=kind, default=o.default, choices=o.choices or None,
                           metavar=o.metavar, help=o.help + ("" if o.default is None else " (default %(default)s)"))


def from_namespace(ns: argparse.Namespace, cls: type[EngineArgs] = EngineArgs) -> dict[str, Any]:
    """The engine's options out of parsed flags, as keywords for ``cls`` (or ``EngineConfig``)."""
    return {o.name: getattr(ns, o.name) for o in options(cls)}


def to_flags(args: EngineArgs) -> list[str]:
    """The command-line flags that give a worker ``args``: each option not at its default."""
    out: list[str] = []
    for o in options(type(args)):
        value = getattr(args, o.name)
        if value == o.default:
            continue
        if o.kind is bool:
            out.append(o.flags[0] if value else "--no-" + o.flags[0].removeprefix("--"))
        else:
            out += [o.flags[0], str(value)]
    return out
