"""Security configuration refused or accepted before anything listens: plaintext beyond
loopback, API key files, a port another live server holds."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from services.common.auth import ApiKeys
from services.common.security import MeshSecurity, SecurityError, is_loopback
from services.common.server import start_server


def test_plaintext_listens_only_on_loopback_unless_allowed(caplog):
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        assert is_loopback(host)
        MeshSecurity().check_listen(host, "test")
    for host in ("0.0.0.0", "::", "10.0.0.5", "kervan.example.com"):
        assert not is_loopback(host)
        with pytest.raises(SecurityError, match="without TLS"):
            MeshSecurity().check_listen(host, "test")
    with caplog.at_level(logging.WARNING):
        MeshSecurity(allow_plaintext=True).check_listen("0.0.0.0", "test")
    assert "WITHOUT TLS" in caplog.text


def test_a_service_asked_to_listen_beyond_loopback_in_plaintext_exits_saying_why():
    out = subprocess.run([sys.executable, "-m", "services.scheduler", "--host", "0.0.0.0", "--registry",
                          "127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "without TLS" in out.stderr and "--allow-plaintext" in out.stderr


def test_tls_material_must_be_complete():
    with pytest.raises(SecurityError, match="key"):
        MeshSecurity(cert=b"x")
    with pytest.raises(SecurityError, match="CA"):
        MeshSecurity(cert=b"x", key=b"y")


def test_api_key_files_are_checked_and_keys_compared_whole(tmp_path):
    good = tmp_path / "keys"
    good.write_text("# keys\nk-0123456789abcdef\n\nk-old-0123456789abcdef expires=2020-01-01T00:00:00+00:00\n"
                    "k#with-a-hash-0123456789 expires=2999-01-01T00:00:00Z  # a comment after a space\n")
    keys = ApiKeys.from_file(good)
    assert keys.check({"authorization": "Bearer k#with-a-hash-0123456789"}) is None  # '#' inside a key is kept
    assert keys.check({"authorization": "Bearer k"}) == "invalid API key"
    assert keys.check({"authorization": "Bearer k-0123456789abcdef"}) is None
    assert keys.check({"authorization": "bearer k-0123456789abcdef"}) is None  # the scheme is case-insensitive
    assert keys.check({"authorization": "Bearer k-0123456789abcde"}) == "invalid API key"
    assert keys.check({"authorization": "Bearer k-0123456789abcdefg"}) == "invalid API key"
    assert keys.check({"authorization": "Basic k-0123456789abcdef"}).startswith("missing API key")
    assert keys.check({}).startswith("missing API key")
    assert keys.check({"authorization": "Bearer k-old-0123456789abcdef"}) == "expired API key"
    for text, words in (("short\n", "at least 16"), ("k-0123456789abcdef scope=all\n", "unknown key option"),
                        ("# nothing\n", "no API key")):
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(ValueError, match=words):
            ApiKeys.from_file(bad)


async def test_a_port_a_live_server_holds_is_not_shared():
    """gRPC sets SO_REUSEPORT by default: a second process (a replacement started too early)
    would bind the same port and the two would split the connections."""
    first = await start_server([])
    try:
        with pytest.raises(OSError, match="cannot bind"):
            await start_server([], port=first.port)
    finally:
        await first.stop(0)
