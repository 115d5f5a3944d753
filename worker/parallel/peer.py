# mypy: disable-error-code="arg-type,attr-defined"
"""``python -m worker.parallel.peer``: rank 1..N-1 of a worker group (started by rank 0,
``group.py``). It loads its shard of the model, allocates its shard of the KV cache and
runs each step rank 0 broadcasts (a pipeline stage: its stage of each micro-batch),
until rank 0 says stop or goes away."""

from __future__ import annotations

import argparse
import ctypes
import signal
import sys

import torch
import torch.distributed


def _die_with_parent() -> None:
    """SIGKILL this process when the process that started it (rank 0) dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.parallel.peer")
    ap.add_argument("--model", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", required=True, help="the group's store file (in rank 0's private directory)")
    ap.add_argument("--config", required=True, help="rank 0's resolved EngineConfig, as JSON")
    ap.add_argument("--shm", default="", help="the group's shared-memory segment (CPU groups)")
    args = ap.parse_args(argv)
    _die_with_parent()

    from worker.loader import load_model
    from worker.parallel import get_parallel_state
    from worker.parallel.group import (
        MICRO_BATCHES,
        READ_KV,
        STEP,
        STOP,
        WRITE_KV,
        init_rank,
        peer_config,
        receive,
        shm_comm,
    )
    from worker.parallel.kv_shards import decode_write
    from worker.parallel.pipeline import run_later_stage
    from worker.runner.model_runner import ModelRunner

    config = peer_config(args.config)
    if config.world_size != args.world:
        raise SystemExit(f"--world {args.world} but the config makes a group of {config.world_size}")
    # mapped before the rendezvous, after which rank 0 removes its name
    shm = shm_comm(args.shm, args.rank, config, create=False) if args.shm else None
    control = init_rank(args.rank, config, args.store, shm)
    runner = ModelRunner(load_model(args.model, config.dtype, config.max_model_len, config.device,
                                    config.quantization), config)
    ps = get_parallel_state()
    with torch.inference_mode():
        while True:
            try:
                kind, message = receive(control, shm)
                if kind == STOP:
                    torch.distributed.destroy_process_group()
                    return 0
                if kind == STEP:
                    runner.forward(message)
                elif kind == READ_KV:  # rank 0 exports a prompt's KV: it gathers every rank's part
                    runner.read_blocks(message.tolist())
                elif kind == WRITE_KV:  # imported KV: this rank keeps its part
                    cfg = runner.model.cfg
                    block_shape = (cfg.num_layers, 2, cfg.num_kv_heads, config.block_size * cfg.head_dim)
                    runner.write_blocks(*decode_write(message, config.dtype, block_shape))
                elif kind == MICRO_BATCHES:
                    for step in message:
                        run_later_stage(lambda s, carried: runner.forward(s, carried=carried), step, ps,
                                        runner.model.cfg.hidden_size, config.dtype, runner.device)
            except (RuntimeError, ValueError) as exc:  # a rank is gone or hangs (or sent garbage): so is the group
                print(f"worker group rank {args.rank}: group lost ({exc})", file=sys.stderr, flush=True)
                return 1


if __name__ == "__main__":
    sys.exit(main())
