"""Progress on a terminal, silence elsewhere: a phase draws a live line (tqdm) only where
stderr is a terminal and neither --quiet nor KERVAN_QUIET asks for none; a line with its wall
time is printed either way, and ``kervan up``'s start line names what is still starting."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

from control_plane.cli.start_progress import StartProgress
from kervan.progress import Phases

SNIPPET = """
import time
from kervan.progress import Phases
phases = Phases(quiet={quiet})
with phases.phase("build", "building") as line:
    time.sleep(0.5)
    line.set_description_str("building: half", refresh=True)
    time.sleep(0.5)
print(phases.summary())
"""


def run_on_a_terminal(quiet: bool = False, env: dict | None = None) -> str:
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))  # a terminal 100 wide
    proc = subprocess.Popen([sys.executable, "-c", SNIPPET.format(quiet=quiet)], stdout=subprocess.PIPE,
                            stderr=follower, env={**os.environ, **(env or {})})
    os.close(follower)
    out, _ = proc.communicate(timeout=60)
    drawn = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal's other end closed
            break
        if not chunk:
            break
        drawn += chunk
    os.close(leader)
    assert proc.returncode == 0 and out.decode().startswith("build "), out
    return drawn.decode(errors="replace")


def test_a_phase_is_drawn_live_on_a_terminal_and_ends_with_its_time():
    drawn = run_on_a_terminal()
    assert "\rbuilding 00:00" in drawn and "\rbuilding: half 00:0" in drawn
    assert "building: 1." in drawn or "building: 0.9" in drawn  # the closing line, with its wall time


def test_quiet_or_kervan_quiet_leave_only_the_closing_line():
    for drawn in (run_on_a_terminal(quiet=True), run_on_a_terminal(env={"KERVAN_QUIET": "1"})):
        assert "\r" not in drawn.replace("\r\n", "\n") and drawn.strip().startswith("building: ")


def test_off_a_terminal_a_phase_prints_one_line(capsys):
    phases = Phases()
    with phases.phase("load", "loading"):
        pass
    assert capsys.readouterr().err.startswith("loading: 0.") and set(phases.timings) == {"load"}


def test_the_start_line_names_what_still_starts():
    class Line:
        def __init__(self):
            self.shown = []
            self.refreshed = 0

        def set_description_str(self, text, refresh):
            self.shown.append(text)

        def refresh(self):
            self.refreshed += 1

    line = Line()
    progress = StartProgress(line)
    progress.show(["kv-registry"], ["prefill-0", "decode-0"])
    progress.show(["kv-registry"], ["prefill-0", "decode-0"])  # unchanged: the time redrawn, not the text
    progress.show(["decode-0", "kv-registry", "prefill-0"], [])
    assert line.shown == ["starting the cluster: 1 up, waiting for prefill-0, decode-0", "starting the cluster: 3 up"]
    assert line.refreshed == 3


def test_a_phase_without_ticking_runs_no_thread_even_on_a_terminal(monkeypatch):
    """The launcher gives Redis its death signal only while it runs no other thread: the start
    phase must add none, drawn or not (tqdm's monitor thread included)."""
    import threading

    monkeypatch.setattr("kervan.progress.is_drawn", lambda quiet=False: True)
    before = threading.active_count()
    with Phases().phase("start", "starting", ticking=False) as line:
        line.refresh()
        assert threading.active_count() == before
    with Phases().phase("pull", "pulling"):
        assert threading.active_count() == before + 1  # its ticker
    assert threading.active_count() == before
