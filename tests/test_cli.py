"""The command line as a user runs it: a fresh cache, no model argument, the
default dtype (``auto``) on whatever CPU this is."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kervan.engine_args import EngineArgs, to_flags
from kervan.worker_info import WorkerRole
from tests.cache_helpers import fresh_cache
from tests.dashboard_names import dashboard_queries, exposed_names, query_metric_names
from tests.test_cluster import sample, scrape
from worker.platform import current_platform, dtype_name


@pytest.mark.parametrize("argv", [["control_plane.cli", "complete", "hi", "--deterministic"],
                                  ["services.worker", "--deterministic"]], ids=["complete", "worker"])
def test_deterministic_reaches_the_engine_and_is_refused_where_it_cannot_hold(argv):
    """--deterministic of `kervan complete` and of a worker gets to the engine: without the
    native kernels it is refused, naming why (not silently served batch-variant)."""
    env = {**os.environ, "KERVAN_ATTENTION_BACKEND": "torch"}
    res = subprocess.run([sys.executable, "-m", *argv], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "deterministic mode needs the native CPU kernels" in res.stderr, res.stderr[-2000:]


def test_kervan_complete_writes_the_default_model_and_answers(tmp_path):
    env = fresh_cache(tmp_path)
    cmd = [sys.executable, "-m", "control_plane.cli", "complete", "Once upon a time", "--max-tokens", "12",
           "--seed", "3", "--ignore-eos", "--json"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    [completion] = out["completions"]
    assert len(completion["token_ids"]) == 12 and completion["finish_reason"] == "length"
    assert isinstance(completion["text"], str) and completion["text"]
    assert sorted(p.name for p in (tmp_path / "kervan-tiny-llama-v1").iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json"]
    # a second run reuses the written model and, seeded, says the same thing
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert json.loads(second.stdout)["completions"] == out["completions"]


def test_invalid_option_is_a_clear_error(tmp_path):
    env = {**os.environ, "KERVAN_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "control_plane.cli", "complete", "hi", "--top-p", "0"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "top_p" in res.stderr
    assert not (tmp_path / "kernels").exists()  # said before any wait: no kernel build in this empty cache


def test_generate_refuses_chat_without_a_prompt_and_a_model_without_chat():
    from click.testing import CliRunner

    from control_plane.cli.commands import main
    no_prompt = CliRunner().invoke(main, ["generate", "--chat", "--token-ids", "1,2"])
    assert no_prompt.exit_code == 2 and "--chat needs a PROMPT" in no_prompt.output
    stray = CliRunner().invoke(main, ["generate", "--model", "smollm2-135m", "hi"])
    assert stray.exit_code == 2 and "--model only says whose chat template --chat uses" in stray.output


@pytest.mark.isa
def test_kervan_up_answers_with_dtype_auto_and_its_workers_log_the_platform():
    """README's main command; its workers name the ISA and the dtype ``auto`` chose."""
    cmd = [sys.executable, "-m", "control_plane.cli", "up", "--request", "Once upon a time", "--port", "0",
           "--max-tokens", "8"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("Once upon a time") and len(res.stdout) > len("Once upon a time")
    assert "[length;" in res.stderr and '"completion_tokens": 8' in res.stderr
    log_dir = Path(re.search(r"logs in (\S+)", res.stderr).group(1))
    platform = current_platform()
    for worker in ("prefill-0", "decode-0"):
        text = (log_dir / f"{worker}.log").read_text()
        assert f"isa {platform.cpu.isa} (torch {platform.cpu.torch_capability}" in text, text[-2000:]
        assert f"engine: {dtype_name(platform.auto_dtype('cpu'))} on cpu, native CPU kernels on" in text


@pytest.mark.isa
def test_kervan_info_reports_what_the_engine_decides():
    res = subprocess.run([sys.executable, "-m", "control_plane.cli", "info", "--json"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    platform = current_platform()  # this process reads the same ISA caps as the command did
    assert info["cpu"]["isa"] == platform.cpu.isa and info["device"] == "cpu"
    assert info["dtype_auto"] == dtype_name(platform.auto_dtype("cpu"))
    assert info["packed_dtypes"] == platform.describe()["packed_dtypes"]
    assert info["native_kernels"]["library"].endswith("kervan_kernels.so")
    assert f"-{platform.cpu.isa}-" in info["native_kernels"]["library"]


@pytest.mark.isa
def test_kervan_build_kernels_names_the_library_it_built_or_found():
    platform = current_platform()
    res = subprocess.run([sys.executable, "-m", "control_plane.cli", "build-kernels"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    isa, path = res.stdout.split()[:2]
    assert isa == f"{platform.cpu.isa}:" and f"-{platform.cpu.isa}-" in path and Path(path).is_file()
    # another level, as an image builds every one (deploy/Dockerfile): the library for AVX2 (on an
    # AVX-512 machine, built here; CI's run capped to AVX2 then finds it instead of building it)
    other = subprocess.run([sys.executable, "-m", "control_plane.cli", "build-kernels", "--isa", "avx2"],
                           capture_output=True, text=True, timeout=600)
    assert other.returncode == 0, other.stderr
    isa, path = other.stdout.split()[:2]
    assert isa == "avx2:" and "-avx2-" in path and Path(path).is_file()
    bad = subprocess.run([sys.executable, "-m", "control_plane.cli", "build-kernels", "--isa", "avx9000"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "unknown ISA level 'avx9000'" in bad.stderr


def test_an_unknown_dtype_is_refused_before_anything_starts():
    res = subprocess.run([sys.executable, "-m", "control_plane.cli", "up", "--dtype", "int4", "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "'int4' is not one of 'auto', 'bfloat16', 'float16', 'float32'" in res.stderr


def kervan(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "control_plane.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_kervan_up_serves_kervan_generate_text_token_ids_stop_strings_and_json_until_ctrl_c():
    """The README's cluster commands: ``kervan up`` in the background, ``kervan generate``
    against it, Ctrl-C stops every process. With the planner on (its bounds keep the pools
    as they are: a minimal planner, logging its decisions from the metrics it scrapes)."""
    up = subprocess.Popen([sys.executable, "-m", "control_plane.cli", "up", "--port", "0", "--http-port", "0",
                           "--metrics", "--pin-cores", "--planner", "--planner-interval", "0.5", "--max-prefill", "1",
                           "--max-decode", "1", "--planner-hardware", "l40s"],
                          stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        lines = []
        while not lines or "Ctrl-C stops the cluster" not in lines[-1]:
            line = up.stderr.readline()
            assert line, "".join(lines)[-3000:]
            lines.append(line)
        printed = "".join(lines)
        addr = re.search(r"router on (\S+)", printed).group(1)
        metrics_urls = re.findall(r"metrics: (http://\S+/metrics)", printed)
        assert len(metrics_urls) == 7, printed  # every service but redis, and the planner
        import openai  # the README's OpenAI example, against the HTTP front
        base_url = re.search(r"OpenAI-compatible API on (\S+)", printed).group(1)
        chat = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0).chat.completions.create(
            model="kervan-tiny-llama-v1", max_tokens=8, messages=[{"role": "user", "content": "Tell me a story."}])
        assert chat.choices[0].message.content and chat.usage.completion_tokens <= 8
        children = children_of(up.pid)
        assert len(children) == 7, children  # redis, kv-registry, control plane, scheduler, 2 workers, router
        workers = [pid for pid in children if "services.worker" in Path(f"/proc/{pid}/cmdline").read_text()]
        cores = [os.sched_getaffinity(pid) for pid in workers]
        usable = os.sched_getaffinity(0)
        assert len(workers) == 2 and all(c <= usable for c in cores)  # --pin-cores: each its own share
        assert cores[0].isdisjoint(cores[1]) if len(usable) >= 2 else cores[0] == cores[1] == usable
        log_dir = Path(re.search(r"logs in (\S+)", "".join(lines)).group(1))
        greedy = ["--max-tokens", "24", "--temperature", "0", "--ignore-eos"]
        res = kervan("generate", "--addr", addr, "Once upon a time", *greedy, "--json")
        assert res.returncode == 0, res.stderr
        full = json.loads(res.stdout)
        assert len(full["token_ids"]) == 24 and full["finish_reason"] == "length" and len(full["text"]) > 12
        assert full["usage"]["completion_tokens"] == 24 and full["usage"]["prompt_tokens"] > 0
        # streamed as text, with the finish line on stderr
        res = kervan("generate", "--addr", addr, "Once upon a time", *greedy)
        assert res.returncode == 0 and res.stdout.rstrip("\n") == full["text"], (res.stdout, full["text"])
        assert "[length;" in res.stderr
        # a stop string ends the text right before it
        stop = full["text"][8:12]
        res = kervan("generate", "--addr", addr, "Once upon a time", *greedy, "--stop", stop, "--json")
        stopped = json.loads(res.stdout)
        assert stopped["text"] == full["text"][:full["text"].index(stop)] and stopped["finish_reason"] == "stop"
        # the prompt as token ids: the same answer as the text it encodes
        from kervan.tokenizer import Tokenizer
        from worker.default_model import ensure_default_model
        ids = Tokenizer.from_dir(ensure_default_model()).encode("Once upon a time")
        res = kervan("generate", "--addr", addr, "--token-ids", ",".join(map(str, ids)), *greedy, "--json")
        assert json.loads(res.stdout)["token_ids"] == full["token_ids"]
        # --chat: the prompt as one user message through the served model's chat template
        from control_plane.cli.commands import chat_prompt
        res = kervan("generate", "--addr", addr, "--chat", "Tell me a story.", *greedy, "--json")
        rendered = kervan("generate", "--addr", addr, chat_prompt(ensure_default_model(), "Tell me a story."),
                          *greedy, "--json")
        assert res.returncode == 0 and json.loads(res.stdout)["token_ids"] == json.loads(rendered.stdout)["token_ids"]
        bad = kervan("generate", "--addr", addr, "--token-ids", "1,999999", "--json")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "vocabulary" in bad.stderr
        assert "planner on: every 0.5s" in printed
        decided = [json.loads(line) for line in (log_dir / "planner.jsonl").read_text().splitlines()]
        assert [r for r in decided if r.get("observed", {}).get("rate")], decided[-3:]  # it saw the requests
        assert all(r.get("target", {"prefill": 1, "decode": 1}) == {"prefill": 1, "decode": 1} for r in decided)
        # the Grafana dashboard's every query names metrics this cluster exports (deploy/grafana/kervan.json)
        exposed = exposed_names(metrics_urls)
        used = set().union(*map(query_metric_names, dashboard_queries()))
        assert used <= exposed, sorted(used - exposed)
        # the planner's own: its decisions as it logged them (bounds 1..1: every target 1, no resize)
        planner = scrape(re.search(r"planner metrics: http://(\S+)/metrics", printed).group(1))
        assert sample(planner, "kervan_planner_intervals_total", outcome="decided") >= 1
        assert sample(planner, "kervan_planner_target_workers", pool="decode") == 1
        assert sample(planner, "kervan_planner_scalings_total", pool="decode", direction="up") == 0
    finally:
        up.send_signal(signal.SIGINT)  # Ctrl-C
        rest = up.communicate(timeout=60)[1]
    assert up.returncode == 0, rest[-3000:]
    assert "stopping the cluster" in rest
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]  # every service stopped
    assert sorted(p.stem for p in log_dir.glob("*.log")) == sorted(
        ["control-plane", "decode-0", "kv-registry", "prefill-0", "redis", "router", "scheduler"])


def children_of(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return kids


def test_up_refuses_a_disk_tier_without_its_directory_or_a_host_tier_in_front(llama, tmp_path):
    from click.testing import CliRunner

    from control_plane.cli.commands import main
    for args in (["--kv-disk-bytes", "1048576", "--kv-host-bytes", "1048576"],
                 ["--kv-disk-bytes", "1048576", "--kv-disk-dir", str(tmp_path)]):
        res = CliRunner().invoke(main, ["up", "--model", str(llama[1]), *args])
        assert res.exit_code == 2 and "--kv-disk-bytes needs --kv-disk-dir and --kv-host-bytes" in res.output, args


def test_up_passes_the_speculation_cutoff_to_the_workers_that_speculate_and_refuses_a_negative_one(llama):
    from click.testing import CliRunner

    from control_plane.cli.commands import main
    from control_plane.cli.launcher import ClusterSpec
    spec = ClusterSpec(llama[1], engine=EngineArgs(speculative="ngram", speculative_disable_by_batch_size=0))
    assert to_flags(spec.worker_engine("decode-0", WorkerRole.DECODE)) == [
        "--speculative", "ngram", "--speculative-disable-by-batch-size", "0"]
    assert to_flags(spec.worker_engine("prefill-0", WorkerRole.PREFILL)) == []  # it never speculates
    res = CliRunner().invoke(main, ["up", "--model", str(llama[1]), "--speculative", "ngram",
                                    "--speculative-disable-by-batch-size", "-1"])
    assert res.exit_code == 2 and "--speculative-disable-by-batch-size must be >= 0, got -1" in res.output
