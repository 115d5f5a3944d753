"""``kervan chat`` in a real terminal (tmux) against a real cluster: each turn carries the
history (the second turn's prompt is the whole conversation through the chat template, its
first turn's KV found in the prefix cache), answers stream, Ctrl-C stops an answer — the
worker counts the abort — and the program goes on to answer the next question; Ctrl-D
leaves. Skips, saying why, where tmux is not installed."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import time
import uuid

import grpc
import pytest

from control_plane.cli.client import Completion, accumulate, build_request, stream
from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.chat_template import ChatTemplate
from kervan.engine_args import EngineArgs
from kervan.tokenizer import Tokenizer
from services.proto import worker_pb2, worker_pb2_grpc
from worker.default_model import ensure_default_model

USAGE = re.compile(r"\[(\w+) · (\d+) tokens(?: · prompt (\d+) tokens \((\d+) cached\))? · [\d.]+ s\]")
LONG = 160  # tokens an answer runs to (--ignore-eos): long enough to be stopped half-way


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(ClusterSpec(ensure_default_model(), num_prefill=0, num_decode=0, num_both=1,
                            # greedy tokens bit-identical with or without a prefix hit: the test asks
                            # the first turn again, directly, for the exact text of its answer
                            engine=EngineArgs(dtype="float32", num_kv_blocks=256, deterministic=True)),
                tmp_path_factory.mktemp("chat-cluster-logs"))
    c.start(timeout=240)
    yield c
    c.stop()


class Tmux:
    def __init__(self, command: list[str]):
        if shutil.which("tmux") is None:
            pytest.skip("no tmux here (Debian: apt-get install tmux)")
        self.socket = f"kervan-test-{uuid.uuid4().hex[:8]}"  # a server of its own, killed at the end
        self.run("new-session", "-d", "-s", "chat", "-x", "220", "-y", "50", " ".join(command))

    def run(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-J", "-S", "-", "-t", "chat")

    def keys(self, *keys: str) -> None:
        self.run("send-keys", "-t", "chat", *keys)

    def wait_for(self, predicate, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"the terminal never showed what was awaited:\n{self.screen()[-3000:]}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


async def greedy_text(address: str, prompt: str) -> str:
    completion = Completion()
    async for msg in stream(address, build_request(prompt, max_tokens=LONG, temperature=0.0, ignore_eos=True),
                            timeout=120):
        accumulate(completion, msg)
    return completion.text


def num_aborted(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        load = worker_pb2_grpc.WorkerServiceStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10).load
    return load.num_aborted


def test_kervan_chat_keeps_history_streams_and_survives_ctrl_c(cluster, tmp_path):
    exited = tmp_path / "exited"
    command = [sys.executable, "-m", "control_plane.cli", "chat", "--addr", cluster.router_address,
               "--max-tokens", str(LONG), "--ignore-eos", ";", "echo", "exit=$?", ">", str(exited)]
    term = Tmux(command)
    try:
        term.wait_for(lambda s: s.rstrip().endswith("you>"))
        term.keys("Tell me about caravans.", "Enter")
        first = term.wait_for(lambda s: len(USAGE.findall(s)) == 1)
        term.keys("And the camels?", "Enter")
        second = term.wait_for(lambda s: len(USAGE.findall(s)) == 2)
        (_, n1, p1, c1), (_, n2, p2, c2) = [(r, int(n), int(p), int(c)) for r, n, p, c in USAGE.findall(second)]
        assert n1 == n2 == LONG and c1 == 0
        template, tokenizer = ChatTemplate.from_dir(ensure_default_model()), Tokenizer.from_dir(ensure_default_model())
        asked = [{"role": "user", "content": "Tell me about caravans."}]
        answer = asyncio.run(greedy_text(cluster.router_address, template.render(asked)))
        shown = first.split("Tell me about caravans.", 1)[1].split("\n[", 1)[0]
        assert "".join(answer.split())[:30] in "".join(shown.split())  # what the terminal showed, streamed
        history = [*asked, {"role": "assistant", "content": answer}, {"role": "user", "content": "And the camels?"}]
        assert p2 == len(tokenizer.encode(template.render(history))), (p2, answer)  # the whole conversation
        assert c2 >= p1 // 2  # the first turn's prompt came from the prefix cache

        aborted = num_aborted(cluster.addresses["both-0"])
        term.keys("One more story, please.", "Enter")
        term.wait_for(lambda s: len(s.split("One more story, please.", 1)[-1].strip()) > 20)  # it streams
        term.keys("C-c")
        stopped = term.wait_for(lambda s: "[stopped" in s and s.rstrip().endswith("you>"), timeout=30)
        assert not re.search(rf"\[stopped · {LONG} tokens", stopped)  # stopped half-way, not at its end
        deadline = time.monotonic() + 10
        while num_aborted(cluster.addresses["both-0"]) == aborted and time.monotonic() < deadline:
            time.sleep(0.1)
        assert num_aborted(cluster.addresses["both-0"]) == aborted + 1  # the request ended on the worker too

        term.keys("Still there?", "Enter")
        # the program went on: a fourth usage line (the stopped answer's is the third)
        term.wait_for(lambda s: len(USAGE.findall(s)) == 4 and s.rstrip().endswith("you>"))
        term.keys("C-d")
        deadline = time.monotonic() + 20
        while not exited.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert exited.is_file() and exited.read_text().strip() == "exit=0", term.screen()[-2000:]
    finally:
        term.close()
