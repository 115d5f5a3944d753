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


@pytest.mark.parametrize(("value", "expected"), [("false", False), ("0", False), ("No", False), ("off", False),
                                                 ("true", True), ("1", True), ("YES", True), (" on ", True)])
def test_an_environment_switch_means_what_it_says(monkeypatch, value, expected):
    """``KERVAN_ROUTER_ALLOW_PLAINTEXT=false`` once turned plaintext on: any non-empty string was True."""
    from services.router.__main__ import parse_args as router_args
    from services.scheduler.__main__ import parse_args as scheduler_args
    monkeypatch.setenv("KERVAN_ROUTER_ALLOW_PLAINTEXT", value)
    monkeypatch.setenv("KERVAN_ROUTER_SHARED_PREFIX_CACHE", value)
    monkeypatch.setenv("KERVAN_SCHEDULER_SHORTLIST", value)  # a store_false switch: the variable is its dest
    args = router_args(["--scheduler", "127.0.0.1:1", "--model", "x"])
    assert (args.allow_plaintext, args.shared_prefix_cache) == (expected, expected)
    assert scheduler_args(["--registry", "127.0.0.1:1"]).shortlist is expected


@pytest.mark.parametrize("value", ["", "maybe", "2", "enabled"])
def test_an_environment_switch_that_is_not_a_boolean_is_refused_by_name(monkeypatch, capsys, value):
    from services.router.__main__ import parse_args as router_args
    monkeypatch.setenv("KERVAN_ROUTER_ALLOW_PLAINTEXT", value)
    with pytest.raises(SystemExit):
        router_args(["--scheduler", "127.0.0.1:1", "--model", "x"])
    assert f"KERVAN_ROUTER_ALLOW_PLAINTEXT={value!r}" in capsys.readouterr().err
