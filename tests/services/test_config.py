import pytest

from services.common.config import env_name
from services.worker.__main__ import parse_args


def test_environment_sets_options_and_flags_win(monkeypatch):
    monkeypatch.setenv("KERVAN_WORKER_NUM_KV_BLOCKS", "512")
    monkeypatch.setenv("KERVAN_WORKER_ROLE", "decode")
    args = parse_args([])
    assert (args.num_kv_blocks, args.role) == (512, "decode")
    assert parse_args(["--num-kv-blocks", "64"]).num_kv_blocks == 64
    assert env_name("kv_registry", "block_size") == "KERVAN_KV_REGISTRY_BLOCK_SIZE"


def test_bad_environment_value_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setenv("KERVAN_WORKER_NUM_KV_BLOCKS", "many")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "KERVAN_WORKER_NUM_KV_BLOCKS" in capsys.readouterr().err


def test_the_step_token_budget_is_a_worker_flag_defaulting_to_the_engines():
    """Chunked prefill's budget (vLLM's --max-num-batched-tokens): an aggregated worker with a
    small one interleaves long prompts with decode steps."""
    from worker.config import EngineConfig
    assert parse_args([]).max_num_batched_tokens == EngineConfig.max_num_batched_tokens
    assert parse_args(["--max-num-batched-tokens", "256"]).max_num_batched_tokens == 256
