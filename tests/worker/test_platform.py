"""Hardware detection and the decisions made from it, on faked CPUs: the ISA level
(capped by PyTorch's and oneDNN's variables), what ``dtype="auto"`` stands for,
which dtypes are packed, and the warning for a dtype the hardware runs slowly."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from worker.config import ConfigError, EngineConfig
from worker.platform import CpuInfo, CudaInfo, DtypeError, Platform, current_platform, read_cpuinfo

X86 = {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "f16c"}
ZEN3 = frozenset(X86 | {"avx2", "fma", "bmi2"})
ZEN4 = frozenset(ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "avx512_vnni"})
SKYLAKE_X = frozenset(ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})
SAPPHIRE_RAPIDS = frozenset(ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"})
GRAVITON3 = frozenset({"fp", "asimd", "asimdhp", "sve", "bf16", "i8mm"})


def cpu(flags, capability, onednn_cap="", arch="x86_64"):
    return CpuInfo(arch=arch, model="test", num_cores=2, flags=flags, torch_capability=capability,
                   onednn_cap=onednn_cap)


@pytest.mark.parametrize("name, info, isa, native_bf16, auto, packed", [
    ("zen3", cpu(ZEN3, "AVX2"), "avx2", False, torch.float32, {torch.float32}),
    ("zen4", cpu(ZEN4, "AVX512"), "avx512", True, torch.bfloat16, {torch.float32, torch.bfloat16}),
    # the caps: PyTorch's alone, oneDNN's alone, both; the decision must read the capped level
    ("zen4 torch-capped", cpu(ZEN4, "AVX2"), "avx2", False, torch.float32, {torch.float32}),
    ("zen4 onednn-capped", cpu(ZEN4, "AVX512", "AVX2"), "avx2", False, torch.float32, {torch.float32}),
    ("zen4 both capped", cpu(ZEN4, "AVX2", "AVX2"), "avx2", False, torch.float32, {torch.float32}),
    ("zen4 onednn without bf16", cpu(ZEN4, "AVX512", "AVX512_CORE"), "avx512", False, torch.float32,
     {torch.float32, torch.bfloat16}),
    ("skylake-x", cpu(SKYLAKE_X, "AVX512"), "avx512", False, torch.float32, {torch.float32, torch.bfloat16}),
    ("sapphire rapids", cpu(SAPPHIRE_RAPIDS, "AVX512"), "avx512", True, torch.bfloat16,
     {torch.float32, torch.bfloat16}),
    ("pre-avx2", cpu(frozenset(X86), "DEFAULT"), "baseline", False, torch.float32, set()),
    ("no cpuinfo", cpu(frozenset(), "AVX2"), "baseline", False, torch.float32, set()),
    ("graviton3", cpu(GRAVITON3, "SVE256", arch="aarch64"), "sve", True, torch.bfloat16, set()),
    ("arm without bf16", cpu(frozenset({"fp", "asimd"}), "DEFAULT", arch="aarch64"), "neon", False,
     torch.float32, set()),
])
def test_detection_and_decisions(name, info, isa, native_bf16, auto, packed):
    platform = Platform(cpu=info)
    assert info.isa == isa
    assert info.has_native_bf16 is native_bf16
    assert platform.device == "cpu"
    assert platform.auto_dtype("cpu") == auto
    assert {d for d in (torch.float32, torch.bfloat16, torch.float16) if info.can_pack(d)} == packed


def test_the_hardware_level_ignores_the_caps():
    # what tells the ISA-capped test run whether the uncapped one already took the AVX2 path
    assert cpu(ZEN4, "AVX2", "AVX2").x86_hardware_level == "avx512"
    assert cpu(ZEN3, "AVX2").x86_hardware_level == "avx2"
    assert cpu(frozenset(X86), "DEFAULT").x86_hardware_level == "baseline"


def test_amx_needs_its_flags_and_no_cap_that_removes_it():
    assert cpu(SAPPHIRE_RAPIDS, "AVX512").has_amx
    assert not cpu(ZEN4, "AVX512").has_amx
    assert not cpu(SAPPHIRE_RAPIDS, "AVX512", "AVX512_CORE_BF16").has_amx
    assert not cpu(SAPPHIRE_RAPIDS, "AVX2").has_amx


@pytest.mark.parametrize("capability, bf16, auto", [((9, 0), True, torch.bfloat16), ((8, 0), True, torch.bfloat16),
                                                     ((7, 5), False, torch.float16)])
def test_cuda_dtype(capability, bf16, auto):
    platform = Platform(cpu=cpu(ZEN3, "AVX2"), cuda=CudaInfo(name="gpu", capability=capability, count=1))
    assert platform.device == "cuda" and platform.resolve_device("auto") == "cuda"
    assert platform.resolve_device("cpu") == "cpu"
    assert platform.cuda.has_bf16 is bf16
    assert platform.auto_dtype("cuda") == auto
    assert platform.auto_dtype("cpu") == torch.float32  # the CPU's own answer still holds for device="cpu"
    assert not platform.can_pack(torch.float32, "cuda")


def test_an_explicit_slow_dtype_works_with_one_warning_naming_the_faster_one(caplog):
    zen3, zen4 = Platform(cpu=cpu(ZEN3, "AVX2")), Platform(cpu=cpu(ZEN4, "AVX512"))
    with caplog.at_level(logging.WARNING, logger="worker.platform"):
        assert zen3.resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    [record] = caplog.records
    assert "bfloat16 is emulated on this CPU (ISA avx2" in record.message and "float32 is faster" in record.message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="worker.platform"):
        assert zen3.resolve_dtype("float32", "cpu") == torch.float32
        assert zen3.resolve_dtype("auto", "cpu") == torch.float32
        assert zen4.resolve_dtype("auto", "cpu") == torch.bfloat16
        assert zen4.resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    assert caplog.records == []
    with caplog.at_level(logging.WARNING, logger="worker.platform"):
        assert zen4.resolve_dtype("float32", "cpu") == torch.float32
    [record] = caplog.records
    assert "bfloat16 is faster" in record.message


@pytest.mark.parametrize("bad", ["int8", "float64", "", "bfloat", torch.float64])
def test_an_unknown_dtype_is_refused_naming_the_allowed_values(bad):
    with pytest.raises(DtypeError, match="auto, bfloat16, float16, float32"):
        Platform(cpu=cpu(ZEN3, "AVX2")).resolve_dtype(bad, "cpu")
    with pytest.raises(ConfigError, match="auto, bfloat16, float16, float32"):
        EngineConfig(dtype=bad)


def test_engine_config_defaults_to_auto_and_rejects_unknown_devices():
    assert EngineConfig().dtype == "auto" and EngineConfig().device == "auto"
    assert EngineConfig(dtype="fp32").dtype == torch.float32
    with pytest.raises(ConfigError, match="device 'tpu' unknown"):
        EngineConfig(device="tpu")


def test_read_cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n"
                    "flags\t\t: fpu avx2 fma avx512f\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert read_cpuinfo(str(path)) == ("AMD EPYC 9R14", frozenset({"fpu", "avx2", "fma", "avx512f"}))
    assert read_cpuinfo(str(tmp_path / "missing")) == ("", frozenset())


@pytest.mark.skipif(not current_platform().cpu.is_x86 or current_platform().cpu.isa == "baseline",
                    reason="needs an x86 CPU with AVX2")
def test_the_real_detection_honours_the_standard_caps():
    """What a capped CI step relies on: both variables reach Kervan's decision."""
    code = ("from worker.platform import current_platform as p; c = p().cpu; "
            "print(c.isa, c.torch_capability, c.has_native_bf16, p().auto_dtype('cpu'))")
    for env in ({"ATEN_CPU_CAPABILITY": "avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                             text=True, timeout=120, check=True).stdout.split()
        assert out[0] == "avx2" and out[2] == "False" and out[3] == "torch.float32", (env, out)
