"""``kervan up`` as a supervisor: a service that dies is restarted (with back-off) and the
cluster answers again; when the launcher itself dies — SIGKILL, or SIGHUP as when its
terminal closes — no service it started outlives it or keeps its port."""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.test_cli import children_of, kervan


def start_up() -> tuple[subprocess.Popen, str, list[str]]:
    up = subprocess.Popen([sys.executable, "-m", "control_plane.cli", "up", "--port", "0", "--prefill", "0",
                           "--decode", "0", "--both", "1"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                          text=True, start_new_session=True)
    lines: list[str] = []
    while not lines or "Ctrl-C stops the cluster" not in lines[-1]:
        line = up.stderr.readline()
        assert line, "".join(lines)[-3000:]
        lines.append(line)
    return up, re.search(r"router on (\S+)", "".join(lines)).group(1), lines


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pids) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}").exists() and "(Z)" not in _state(p)]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
    except OSError:
        return "(Z)"


def wait_gone(pids, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


def port_free(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def bind_as_another_user(port: int) -> int:
    """errno of binding 127.0.0.1:``port`` from a child of another uid (nobody), 0 if it bound:
    a local user squatting the port of a service in its restart gap. Forked, not executed: the
    venv's interpreter need not be readable by that user."""
    pid = os.fork()
    if pid == 0:  # the child: a syscall or two, then out (never back into pytest)
        code = 0
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            code = exc.errno or 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_killed_worker_is_restarted_and_a_killed_launcher_takes_every_service_with_it():
    up, addr, _ = start_up()
    try:
        children = children_of(up.pid)
        assert len(children) == 6, children  # redis, kv-registry, control plane, scheduler, worker, router
        [worker] = [p for p in children if "services.worker" in cmdline(p)]
        greedy = ["--max-tokens", "4", "--temperature", "0", "--ignore-eos", "--json"]
        assert kervan("generate", "--addr", addr, "Once upon a time", *greedy).returncode == 0
        port = int(re.search(r"--port (\d+)", cmdline(worker)).group(1))
        subprocess.run(["kill", "-9", str(worker)], check=True)
        wait_gone([worker], 10)
        if os.geteuid() == 0:  # in the restart gap no other user can take its port (and what clients send it)
            assert bind_as_another_user(port) == errno.EADDRINUSE
        line = up.stderr.readline()
        assert re.match(r"kervan: both-0 exited; restarted it \(restart 1\)", line), line
        deadline = time.monotonic() + 90
        while True:  # the new process registers once the old one's lease has run out
            res = kervan("generate", "--addr", addr, "Once upon a time", *greedy)
            if res.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert res.returncode == 0, res.stderr
        children = children_of(up.pid)
        assert worker not in children and len(children) == 6
    finally:
        up.kill()  # SIGKILL: no chance to stop anything itself
        up.wait()
    assert wait_gone(children, 45) == [], [cmdline(p) for p in alive(children)]
    assert port_free(addr)


def test_sighup_stops_the_cluster_like_ctrl_c():
    up, addr, _ = start_up()
    children = children_of(up.pid)
    up.send_signal(signal.SIGHUP)  # the terminal closed
    rest = up.communicate(timeout=60)[1]
    assert up.returncode == 0 and "stopping the cluster" in rest, rest[-2000:]
    assert alive(children) == [] and port_free(addr)


def test_stop_kills_services_that_ignore_sigterm_and_names_them(tmp_path, capsys):
    """A service that hangs in its drain is SIGKILLed after the grace, and the launcher says
    which one and where its log is (the stop of every service after it shares one bound)."""
    from control_plane.cli.launcher import Cluster, ClusterSpec
    cluster = Cluster(ClusterSpec(tmp_path), tmp_path)
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    for name in ("deaf-0", "deaf-1", "deaf-2"):
        cluster._spawn(name, [sys.executable, "-c", deaf])
    for name in ("deaf-0", "deaf-1", "deaf-2"):  # each has set its handler before the stop
        while b"up" not in (tmp_path / f"{name}.log").read_bytes():
            time.sleep(0.05)
    procs = dict(cluster.procs)
    cluster.stop(grace=1.0)
    assert {name: p.returncode for name, p in procs.items()} == {name: -signal.SIGKILL for name in procs}
    err = capsys.readouterr().err
    for name in procs:
        assert f"{name} did not stop within 1s of SIGTERM: killed (its log: {tmp_path / name}.log)" in err, err
