"""What a command a person runs does before it serves: find the model, pulling a catalog
model on first use, while the native CPU kernels build in a thread beside it (two compiles on
two cores, ~40 s, once per machine and ISA level): the pull (download, config and tokenizer)
hides behind the build. Each is a timed phase with its progress on the terminal
(``kervan.progress``).

The build is waited for before ``kervan up`` starts a service: the launcher gives Redis its
death signal only while it runs no other thread (``launcher.py``), and on two cores services
starting beside the compiles only slowed both (measured: the start went from 12 s to 31-33 s,
the whole first start stayed at 57-59 s)."""

from __future__ import annotations

import threading
from pathlib import Path

import click

from control_plane.tools.model_arg import model_path
from kervan.progress import Phases


class KernelBuild:
    """The native kernels for this CPU's ISA level, built in a thread unless already built,
    not used (``KERVAN_ATTENTION_BACKEND=torch``) or not for this device."""

    def __init__(self) -> None:
        self.isa = ""
        self.error: Exception | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> KernelBuild:
        from kervan.envs import attention_backend, cache_dir
        from worker.kernels.build import find_built  # torch: imported only when needed
        from worker.platform import current_platform

        platform = current_platform()
        self.isa = platform.cpu.isa
        if attention_backend() == "torch" or platform.device != "cpu" or find_built(cache_dir(), self.isa):
            return self
        self.thread = threading.Thread(target=self._build, name="kernel-build", daemon=True)
        self.thread.start()
        return self

    def _build(self) -> None:
        from kervan.envs import cache_dir
        from worker.kernels.build import BUILD_TIMEOUT_S, KernelBuildError, ensure_built
        try:
            ensure_built(cache_dir(), self.isa, wait_s=BUILD_TIMEOUT_S)
        except KernelBuildError as exc:
            self.error = exc

    def wait(self, phases: Phases) -> None:
        """Until the build ends (a phase of its own for the time still left); the thread is
        gone when it returns."""
        if self.thread is None:
            return
        if self.thread.is_alive():
            with phases.phase("kernels", f"building the native CPU kernels for {self.isa} (once per machine)"):
                self.thread.join()
        if self.error is not None:
            click.echo(f"the kernels did not build ({self.error}); serving falls back to PyTorch", err=True)


def prepare(model: str | None, phases: Phases) -> Path:
    """The model's directory, pulled if need be, with the kernels built (and no thread of
    this module left) by the time it returns."""
    kernels = KernelBuild().start()
    if model is None:
        click.echo("serving the embedded model: random weights for tests, its text is noise; "
                   "--model smollm2-135m serves a real one (pulled on first use)", err=True)
    try:
        return model_path(model, pull_missing=True, phases=phases)
    finally:
        kernels.wait(phases)
