"""The API's sources lint clean and the committed stubs match them, whichever patch release
of the generator a fresh install takes; the runtime floors in pyproject cover the stubs."""

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
# protos/generate.py is a script, not a package: loaded by path, leaving sys.path alone
_spec = importlib.util.spec_from_file_location("generate", ROOT / "protos" / "generate.py")
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)

STUBS = ROOT / "services" / "proto"


def test_buf_lint_passes():
    buf = shutil.which("buf")
    assert buf, "buf is missing: pip install buf-bin (part of the [test] extra)"
    res = subprocess.run([buf, "lint"], cwd=ROOT / "protos", capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_generated_stubs_are_up_to_date():
    res = subprocess.run([sys.executable, "protos/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def stamped(text: str, grpc_version: str, protobuf_version: str) -> str:
    """``text`` as a generator of these versions would have stamped it."""
    major, minor, patch = protobuf_version.split(".")
    text = re.sub(r"^GRPC_GENERATED_VERSION = '[0-9.]+'$", f"GRPC_GENERATED_VERSION = '{grpc_version}'", text,
                  flags=re.M)
    text = re.sub(r"^# Protobuf Python Version: \S+$", f"# Protobuf Python Version: {protobuf_version}", text,
                  flags=re.M)
    return re.sub(r"(Domain\.PUBLIC,\n)\s*\d+,\n\s*\d+,\n\s*\d+,\n",
                  rf"\g<1>    {major},\n    {minor},\n    {patch},\n", text)


def test_the_check_ignores_a_newer_generator_patch_release_but_not_a_changed_api(tmp_path):
    """Stubs as grpcio-tools 1.85.99 (protoc 7.35.99) would write them pass against the committed
    ones; a renamed method or a changed descriptor does not."""
    fresh = tmp_path / "fresh"
    generate.generate(fresh)
    for path in fresh.glob("*_pb2*.py"):  # the .pyi carry no stamp
        text = path.read_text()
        newer = stamped(text, "1.85.99", "7.35.99")
        assert newer != text, f"{path.name}: no version stamp found to change"
        path.write_text(newer)
    assert generate.stale_stubs(STUBS, fresh) == []

    grpc_stub = fresh / "router_pb2_grpc.py"
    grpc_stub.write_text(grpc_stub.read_text().replace("RouterService/Generate", "RouterService/Gen"))
    message = fresh / "common_pb2.py"
    message.write_text(message.read_text().replace("max_tokens", "max_tokenz", 1))
    assert generate.stale_stubs(STUBS, fresh) == ["common_pb2.py", "router_pb2_grpc.py"]


def floor(requirement: str) -> Version:
    """The ``>=`` floor pyproject gives a runtime dependency."""
    found = re.search(rf'"{re.escape(requirement)}>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert found, f"pyproject.toml gives {requirement} no >= floor"
    return Version(found.group(1))


def test_pyproject_floors_cover_the_versions_the_stubs_require():
    """A stub refuses to import under an older runtime than its generator's: stubs regenerated
    by a newer grpcio-tools must come with the floors raised, or a fresh install may break."""
    for path in sorted(STUBS.glob("*_pb2_grpc.py")):
        wanted = re.search(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", path.read_text(), re.M).group(1)
        assert Version(wanted) <= floor("grpcio"), f"{path.name} needs grpcio>={wanted}"
    for path in sorted(STUBS.glob("*_pb2.py")):
        wanted = re.search(r"Domain\.PUBLIC,\n\s*(\d+),\n\s*(\d+),\n\s*(\d+),", path.read_text())
        version = Version(".".join(wanted.groups()))
        assert version <= floor("protobuf"), f"{path.name} needs protobuf>={version}"
