"""spec_plugins.cpu_features: the CPU-features line ci/test.sh prints first (issue #50 item 1),
parsed from synthetic /proc/cpuinfo texts of the three x86 kinds vLLM-CPU tells apart
(AVX2 only, AVX-512, AMX) and an Arm one."""

from __future__ import annotations

from spec_plugins import cpu_features


def cpuinfo(model: str, flags: str, cpus: int = 2, key: str = "flags", model_key: str = "model name") -> str:
    one = "processor\t: {i}\nvendor_id\t: X\n{mk}\t: {model}\n{key}\t\t: {flags}\n\n"
    return "".join(one.format(i=i, mk=model_key, model=model, key=key, flags=flags) for i in range(cpus))


EPYC_AVX512 = "fpu sse sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni"
XEON_AMX = EPYC_AVX512 + " avx512_fp16 amx_bf16 amx_tile amx_int8 tsxldtrk"
AVX2_ONLY = "fpu sse sse2 avx avx2 fma"


def test_avx512_without_amx():
    line = cpu_features.describe(cpuinfo("AMD EPYC 9R14 96-Core Processor", EPYC_AVX512), "x86_64")
    assert line == "cpu: AMD EPYC 9R14 96-Core Processor (x86_64, 2 cpus) avx2 avx512f avx512_bf16 no-avx512_fp16 no-amx"


def test_amx_xeon_lists_its_amx_flags():
    line = cpu_features.describe(cpuinfo("Intel(R) Xeon(R) Platinum 8488C", XEON_AMX, cpus=4), "x86_64")
    assert line == ("cpu: Intel(R) Xeon(R) Platinum 8488C (x86_64, 4 cpus) avx2 avx512f avx512_bf16 avx512_fp16 "
                    "amx_bf16 amx_int8 amx_tile")


def test_avx2_only():
    line = cpu_features.describe(cpuinfo("AMD EPYC 7B12", AVX2_ONLY, cpus=1), "x86_64")
    assert line.endswith("(x86_64, 1 cpus) avx2 no-avx512f no-avx512_bf16 no-avx512_fp16 no-amx")


def test_amx_flags_without_tiles_are_no_amx():
    assert cpu_features.describe(cpuinfo("X", AVX2_ONLY + " amx_bf16"), "x86_64").endswith(" no-amx")


def test_arm_and_missing_cpuinfo():
    arm = cpu_features.describe(cpuinfo("ignored", "fp asimd sve bf16", key="Features", model_key="CPU part"),
                                "aarch64")
    assert arm == "cpu: unknown model (aarch64, 2 cpus) no-avx2 no-avx512f no-avx512_bf16 no-avx512_fp16 no-amx"
    assert cpu_features.describe(None, "x86_64") == "cpu: unknown (x86_64, no /proc/cpuinfo)"
    assert cpu_features.read_cpuinfo("/nonexistent/cpuinfo") is None


def test_this_machine_prints_one_line():
    line = cpu_features.describe(cpu_features.read_cpuinfo())
    assert line.startswith("cpu: ") and "\n" not in line
