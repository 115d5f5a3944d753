"""The engine's options are written once (``kervan/engine_args.py``): the worker's flags,
``kervan up``'s options, the launcher's worker command lines and ``EngineConfig`` are made
from ``EngineArgs``'s fields. The last test adds one field to a copy of the tree, in that one
file, and finds it on every surface."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from control_plane.cli.engine_options import as_flags, engine_options
from kervan.engine_args import EngineArgs, EngineArgsError, add_arguments, from_namespace, options, to_flags
from worker.config import ConfigError, EngineConfig

ROOT = Path(__file__).resolve().parent.parent


def test_every_field_has_help_and_a_kind_a_command_line_takes():
    for o in options():
        assert o.help and o.kind in (int, float, str, bool), o
        assert o.flags[0].startswith("--"), o


def test_flags_written_for_a_worker_parse_back_to_the_same_options():
    chosen = EngineArgs(dtype="float32", num_kv_blocks=64, kv_host_bytes=1 << 20, kv_disk_dir="/tmp/kv",
                        kv_disk_bytes=1 << 22, enable_prefix_caching=False, deterministic=True,
                        tensor_parallel_size=2, speculative="ngram", num_speculative_tokens=5)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = to_flags(chosen)
    assert "--no-enable-prefix-caching" in flags and "--tensor-parallel" in flags
    assert EngineArgs(**from_namespace(parser.parse_args(flags))) == chosen
    assert to_flags(EngineArgs()) == []  # a default is never written: the worker's default is the same


def test_the_engine_config_is_the_same_fields_checked_against_torch():
    assert [f.name for f in dataclasses.fields(EngineConfig)] == [f.name for f in dataclasses.fields(EngineArgs)]
    with pytest.raises(ConfigError, match="kv_disk_bytes needs kv_disk_dir"):
        EngineConfig(kv_disk_bytes=1)
    with pytest.raises(ConfigError, match="quantization 'int3' unknown"):
        EngineConfig(quantization="int3")  # the quantization methods register in the engine
    with pytest.raises(EngineArgsError, match="max_num_seqs must be >= 1"):
        EngineArgs(max_num_seqs=0)


def test_a_refusal_names_the_flags_on_the_command_line():
    message = "kv_disk_bytes needs kv_disk_dir and kv_host_bytes; tensor_parallel_size 3"
    assert as_flags(message) == "--kv-disk-bytes needs --kv-disk-dir and --kv-host-bytes; --tensor-parallel 3"


def test_a_field_of_a_subclass_reaches_the_worker_flags_the_click_options_and_the_command_line():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Extended(EngineArgs):
        draft_temperature: float = dataclasses.field(default=0.5, metadata={"help": "a knob for this test"})

    parser = argparse.ArgumentParser()
    add_arguments(parser, Extended)
    assert "--draft-temperature" in parser.format_help()

    import click

    @click.command()
    @engine_options(Extended)
    def command(**opts) -> None:
        click.echo(json.dumps(opts["draft_temperature"]))

    assert "--draft-temperature" in CliRunner().invoke(command, ["--help"]).output
    assert CliRunner().invoke(command, ["--draft-temperature", "0.25"]).output.strip() == "0.25"
    assert to_flags(Extended(draft_temperature=0.25)) == ["--draft-temperature", "0.25"]


NEW_FIELD = '''    kv_test_knob: int = option(7, "a knob this test adds in one place")

    def __post_init__(self) -> None:'''

LAUNCHER_ARGV = """
import json, sys, tempfile
from pathlib import Path
from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.engine_args import EngineArgs

class Recording(Cluster):  # the command line the launcher builds, without the process
    def _spawn(self, name, argv, env=None, cores=None):
        self.argv = argv

cluster = Recording(ClusterSpec(Path(sys.argv[1]), engine=EngineArgs(kv_test_knob=9)), Path(tempfile.mkdtemp()))
cluster.addresses["kv-registry"] = "127.0.0.1:1"
cluster.spawn_worker("decode")
cluster.service_hosts.close()
print(json.dumps(cluster.argv))
"""


def test_one_new_field_in_one_file_appears_on_every_surface(tmp_path, llama):
    for top in ("kervan", "worker", "services", "control_plane"):
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    args_file = tmp_path / "kervan" / "engine_args.py"
    source = args_file.read_text()
    assert source.count("\n    def __post_init__(self) -> None:") == 1
    args_file.write_text(source.replace("\n    def __post_init__(self) -> None:", "\n" + NEW_FIELD, 1))

    def run(*argv: str) -> str:
        res = subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(tmp_path)})
        assert res.returncode == 0, res.stderr
        return res.stdout

    assert "--kv-test-knob" in run("-m", "services.worker", "--help")
    assert "--kv-test-knob" in run("-m", "control_plane.cli", "up", "--help")
    argv = json.loads(run("-c", LAUNCHER_ARGV, str(llama[1])))
    assert argv[argv.index("-m") + 1] == "services.worker"
    assert argv[argv.index("--kv-test-knob") + 1] == "9"


def test_a_directory_option_that_does_not_exist_is_refused_before_anything_starts(tmp_path):
    from control_plane.cli.commands import main

    res = CliRunner().invoke(main, ["up", "--speculative", "draft", "--speculative-model", str(tmp_path / "none")])
    assert res.exit_code == 2 and "does not exist" in res.output
