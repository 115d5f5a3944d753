"""Two ranks (gloo on loopback, no shared memory) produce the logits of one.

Tensor parallel: column/row-parallel linears, the vocabulary-parallel embedding and
head, and expert sharding (each rank owns half the experts), for every model family.
Expert parallel: tokens sent to their experts' ranks and back with gloo's
all-to-all (the path CUDA's NCCL takes too), for every mixture-of-experts family.
Both against transformers, in two real processes."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import MODEL_KINDS, MOE_KINDS, make_prompts

WORLD = 2


def _rank_main(rank: int, sizes: tuple[int, int], store: str, paths: dict, prompt: list, results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        from tests.worker.test_model_parity import prompt_logits
        from worker.parallel.state import ParallelState, set_parallel_state
        set_parallel_state(ParallelState(rank, *sizes))
        out = {kind: prompt_logits(path, prompt).tolist() for kind, path in paths.items()}
        if rank == 0:
            results.put(out)  # plain lists: no shared-memory tensors outliving this process
    finally:
        dist.destroy_process_group()


def run_ranks(target, rank_args):
    """``target(*rank_args(rank, results))`` in WORLD spawned processes; what rank 0 put
    on ``results``. Every process is gone afterwards."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=rank_args(r, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        out = results.get(timeout=240)
        for p in procs:
            p.join(timeout=60)
        assert [p.exitcode for p in procs] == [0] * WORLD
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return out


@pytest.mark.parametrize("layout", ["tensor", "expert"])
def test_two_ranks_match_transformers(hf_models, tmp_path, layout):
    sizes = (WORLD, 1) if layout == "tensor" else (1, WORLD)  # (tp_size, ep_size)
    kinds = MODEL_KINDS if layout == "tensor" else [k for k in MODEL_KINDS if k in MOE_KINDS]
    models = {kind: hf_models(kind) for kind in kinds}
    prompt = make_prompts([21], seed=3)[0]
    out = run_ranks(_rank_main, lambda r, results: (r, sizes, str(tmp_path / "store"),
                                                     {k: str(p) for k, (_, p) in models.items()}, prompt, results))
    for kind, (hf, _) in models.items():
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(torch.tensor(out[kind]), ref, rtol=1e-4, atol=1e-4, msg=kind)
