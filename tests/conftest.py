"""Shared fixtures: tiny Hugging Face models from a seeded random init, saved with
safetensors into a temporary folder, so tests need no download."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from kervan.engine_args import EngineArgs

# pytest-xdist runs several test processes on the machine's cores, and each one's torch would start
# a thread per core: two workers on two cores would run four OpenMP threads that spin-wait on each
# other. Each test process takes its share of the cores instead, as `kervan up` gives each worker.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _XDIST_WORKERS))

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            # a wide init keeps the top logits apart, so greedy choices are not coin flips
            initializer_range=0.1, eos_token_id=2, bos_token_id=1)


def _configs():
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        Glm4MoeConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
    )
    # latent attention: a 32 + 8 latent per token, 4 heads of 16 + 8 (queries and keys) and 16 (values)
    mla = dict(TINY, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
               moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5)
    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    return {
        "llama": LlamaConfig(**TINY, rope_scaling=llama3_rope),
        "qwen2": Qwen2Config(**TINY, tie_word_embeddings=True),
        "mistral": MistralConfig(**TINY, sliding_window=None),
        "mixtral": MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": Qwen2MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48),
        "glm4_moe": Glm4MoeConfig(**TINY, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                  first_k_dense_replace=1, n_group=2, topk_group=1, head_dim=16,
                                  routed_scaling_factor=1.5),
        # V2: queries through one q_proj, softmax routing limited to the best group (by its best expert)
        "deepseek_v2": DeepseekV2Config(**mla, q_lora_rank=None, topk_method="group_limited_greedy"),
        # V3: queries through a low-rank projection, sigmoid routing with a correction bias
        "deepseek_v3": DeepseekV3Config(**mla, q_lora_rank=24),
    }


def pytest_terminal_summary(terminalreporter):
    """The machine a run proved, at the end of its log (also under ``-q``): the CPU's ISA after
    any cap, and what dtype=auto picks."""
    from worker.platform import current_platform
    terminalreporter.write_line(f"kervan: {current_platform().summary()}")


def pytest_configure(config):
    """Once per run, in the main process and not in each pytest-xdist worker (which would
    remove what the others recorded): the chaos report starts empty."""
    if not hasattr(config, "workerinput"):
        from tests.chaos.checker import REPORT
        REPORT.unlink(missing_ok=True)


MODEL_KINDS = ["llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v2", "deepseek_v3"]
MOE_KINDS = ["mixtral", "qwen2_moe", "glm4_moe", "deepseek_v2", "deepseek_v3"]


def build_hf_model(kind: str, seed: int = 0):
    import transformers
    cfg = _configs()[kind]
    torch.manual_seed(seed)
    model = getattr(transformers, _ARCH[kind])(cfg).eval()
    if kind in ("glm4_moe", "deepseek_v3"):  # a non-zero correction bias, so routing really depends on it
        g = torch.Generator().manual_seed(seed)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(8, generator=g) * 0.2 - 0.1)
    return model


_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
         "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
         "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


@pytest.fixture
def two_threads():
    """Two threads, whatever the machine: the native kernels split work by sequence only when
    there are twice as many sequences as threads, and a test names which split it exercises."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """kind -> (transformers model, directory it was saved to), built lazily."""
    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            model = build_hf_model(kind)
            path = tmp_path_factory.mktemp(kind)
            model.save_pretrained(path)
            cache[kind] = (model, path)
        return cache[kind]
    return get


@pytest.fixture(scope="session")
def llama(hf_models):
    return hf_models("llama")


def make_engine(model_dir, **options):
    """float32 and the default (batch-variant) kernels: tests that compare greedy tokens across
    batching, chunking or cache hits with it rely on the tiny models' wide init keeping the
    top logits far apart, not on bit equality (that takes ``deterministic=True``:
    tests/worker/test_deterministic.py compares logprobs with ==). Speculation, when asked for,
    runs at every batch size (tests batch more sequences than the default auto-off allows)."""
    from worker import Engine
    options = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 128, **options}
    if options.get("speculative"):
        options.setdefault("speculative_disable_by_batch_size", 0)
    return Engine.from_pretrained(model_dir, **options)


# The chaos suite and the OpenAI front run in the machine's own dtype (bf16 where it is native): a greedy
# request's tokens are exact across migrations and cache hits by the engine's batch invariance, not by a
# float32 forced for its fewer near-ties; --deterministic makes every worker refuse to start where that
# could not hold. EXACT_REFERENCE is the in-process engine that computes the same bits (the mesh's block
# size: the attention kernel is per block size).
EXACT_MESH = dict(dtype="auto", deterministic=True)
EXACT_REFERENCE = dict(EXACT_MESH, block_size=16)


def other_dtype() -> str:
    """The CPU dtype ``auto`` does not pick here, which a user may still ask for: float32 where
    bf16 is native, bf16 (emulated, slowly) where it is not. A dtype-dependent path is tested
    in both: ``pytest.mark.parametrize("dtype", ["auto", other_dtype()])``."""
    from worker.platform import current_platform
    return "float32" if current_platform().auto_dtype("cpu") == torch.bfloat16 else "bfloat16"


def greedy_tokens(model_dir, prompts: list[list[int]], max_tokens: int, **options) -> list[list[int]]:
    """The in-process engine's greedy tokens for each prompt: the reference the mesh's
    answers are checked against (computed once per model, prompts, length and options)."""
    key = tuple(sorted(options.items()))
    return [list(t) for t in _greedy_tokens(str(model_dir), tuple(map(tuple, prompts)), max_tokens, key)]


@functools.cache
def _greedy_tokens(model_dir: str, prompts: tuple, max_tokens: int, options: tuple) -> tuple:
    from worker import SamplingParams
    outs = make_engine(model_dir, **dict(options)).generate(
        [list(p) for p in prompts], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return tuple(tuple(o.token_ids) for o in outs)


def make_prompts(lengths, seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    # avoid the EOS id (2) so prompts never look finished
    return [(torch.randint(3, vocab, (n,), generator=g)).tolist() for n in lengths]


def hf_greedy(model, prompt, max_new_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def cluster(llama, tmp_path_factory):
    """The whole mesh as real processes (redis-server, kv-registry, scheduler, a prefill
    and two decode workers, router), started by the launcher ``kervan up`` uses; shared
    by the tests that need one. Two decode workers, so placement has a choice to get wrong."""
    from control_plane.cli.launcher import Cluster, ClusterSpec
    c = Cluster(ClusterSpec(llama[1], num_prefill=1, num_decode=2,
                            engine=EngineArgs(dtype="float32", num_kv_blocks=256), http_port=0,
                            metrics=True),
                tmp_path_factory.mktemp("cluster-logs"))
    c.start(timeout=240)
    yield c
    procs = dict(c.procs)
    c.stop()
    # SIGTERM drained every service cleanly (redis-server included)
    assert {name: p.returncode for name, p in procs.items()} == {name: 0 for name in procs}


# The files that keep one test process busiest (each 25-95 s on two cores, --durations=0, AMX Xeon
# capped to AVX2), longest first. pytest-xdist (--dist loadfile) hands whole files out in
# collection order: these go first, so the run does not end with one process alone on one of them.
LONG_FILES = ("tests/test_real_model.py", "tests/worker/test_worker_group.py", "tests/test_cli.py",
              "tests/test_mesh_security.py", "tests/test_plan.py", "tests/chaos/test_worker_faults.py",
              "tests/worker/test_kernel_build.py", "tests/chaos/test_control_plane_faults.py",
              "tests/test_launcher_supervision.py", "tests/test_worker_group_cluster.py",
              "tests/chaos/test_network_faults.py", "tests/chaos/test_host_faults.py",
              "tests/chaos/test_planner_ramp.py", "tests/worker/test_batch_invariance.py",
              "tests/test_speculative_cluster.py")


def pytest_collection_modifyitems(config, items):
    """The long files first (``LONG_FILES``). The README's second run, ISA capped to AVX2,
    proves the AVX2 path on a CPU with AVX-512. On an x86 CPU without it the uncapped run
    already took that path: the capped run says so and skips rather than repeat it."""
    root = Path(__file__).resolve().parents[1]
    if missing := [name for name in LONG_FILES if not (root / name).is_file()]:
        raise pytest.UsageError(f"tests/conftest.py's LONG_FILES names files that are gone: {missing}")
    rank = {name: k for k, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONG_FILES)))  # stable: files stay whole
    if config.getoption("markexpr") != "isa" or os.environ.get("ATEN_CPU_CAPABILITY", "").lower() != "avx2":
        return
    from worker.platform import detect_cpu
    cpu = detect_cpu()
    if cpu.is_x86 and cpu.x86_hardware_level != "avx512":
        skip = pytest.mark.skip(reason=f"this CPU's own level is {cpu.x86_hardware_level}: the uncapped run "
                                       "already took the AVX2 path")
        for item in items:
            item.add_marker(skip)
