"""The README's main command, as a user runs it: a fresh cache, no model argument."""

import json
import os
import subprocess
import sys


def test_kervan_complete_writes_the_default_model_and_answers(tmp_path):
    env = {**os.environ, "KERVAN_CACHE_DIR": str(tmp_path)}
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
