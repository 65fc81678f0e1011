"""$BATCHGEN_CPU_MARCH: the C++ ops built for a target below this CPU's, as CPUs of that kind get
them. On an AVX-512 machine the suite's native build never compiles the AVX2 branches of the
attention ops (Zen 2/3, Intel client parts), so one test here builds them (x86-64-v3) and runs
the op tests, and the model families' fast-path test, against them. Branches that this CPU cannot
run, or that its native build leaves out, are at least compiled: the AMX GEMM (Sapphire Rapids),
the AVX-512 and dpbf16 ones (Cooper Lake) and the generic loops of CPUs without AVX2."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from batchgen import workload
from batchgen.kernels import cpu_attention
from conftest import REPO

COMPILER = cpu_attention.compiler()
needs_compiler = pytest.mark.skipif(shutil.which(COMPILER) is None, reason=f"no C++ compiler ({COMPILER}) here")
# the kernel-choosing flags that x86-64-v3 (AVX2, FMA) lacks
BEYOND_V3 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
             "avx_ne_convert"}


@needs_compiler
def test_target_isa_is_what_the_compiler_enables():
    assert cpu_attention.target_isa("native") is None  # all of this CPU's flags
    assert cpu_attention.target_isa("x86-64-v3") == {"avx2", "fma"}
    assert cpu_attention.target_isa("x86-64-v2") == frozenset()
    assert {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"} <= \
        cpu_attention.target_isa("sapphirerapids")


@needs_compiler
def test_the_flags_lose_what_the_target_lacks_and_keep_the_rest(monkeypatch):
    native = workload._cpuinfo()[1]
    monkeypatch.setenv(cpu_attention.MARCH_ENV, "x86-64-v3")
    flags = workload.cpu_flags()
    assert flags == native - BEYOND_V3
    assert "-march=x86-64-v3" in cpu_attention.flags() and "-march=native" not in cpu_attention.flags()
    info = workload.cpu_info()
    assert set(info["isa"]) <= {"avx2"} and info["march"] == "x86-64-v3"
    from batchgen.bench import format_report

    report = {"cpu": info, "model": "m", "workload": {}, "results": [], "ratios": {}, "peak_rss_bytes": 0,
              "ceiling": {"gflops": {}, "ceiling_output_tok_s_float32": 0, "ceiling_output_tok_s_bfloat16": 0,
                          "flop_per_output_token": 0}}
    head = format_report(report).splitlines()[0]
    assert "the ops built for -march=x86-64-v3" in head, head
    monkeypatch.setenv(cpu_attention.MARCH_ENV, "native")
    assert workload.cpu_flags() == native and "-march=native" in cpu_attention.flags()


@needs_compiler
def test_a_target_the_compiler_refuses_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(cpu_attention.MARCH_ENV, "no-such-cpu")
    with pytest.raises(RuntimeError, match=r"BATCHGEN_CPU_MARCH=no-such-cpu: .*refuses -march=no-such-cpu"):
        workload.cpu_flags()


PROBE = """
import json, torch
from batchgen import workload
from batchgen.kernels import cpu_attention
from batchgen.runner import linear
cpu_attention.load()
ops = torch.ops.batchgen_cpu
print(json.dumps({"dpbf16": ops.has_dpbf16_gemm(), "avx512_f32": ops.has_avx512_f32_gemm(),
                  "fma": ops.has_fma_bf16_gemm(), "d96": ops.has_fast_path(32, 32, 96),
                  "attention": workload.cpu_info()["attention_ops"], "fp32_on_fma": linear.fma_f32_preferred(),
                  "bf16_own": linear.own_bf16_path(), "onednn_bf16": linear.onednn_bf16_available()}))
"""


@needs_compiler
@pytest.mark.skipif(os.environ.get("BATCHGEN_NO_CPP") == "1", reason="BATCHGEN_NO_CPP=1: the ops are turned off")
@pytest.mark.skipif(not {"avx512f", "avx2", "fma"} <= workload._cpuinfo()[1],
                    reason="no AVX-512 here: the native build is the AVX2 one, which the op tests run already")
@pytest.mark.skipif(bool(os.environ.get(cpu_attention.MARCH_ENV)),
                    reason="the suite runs under BATCHGEN_CPU_MARCH already")
def test_the_avx2_build_passes_the_op_tests_on_an_avx512_cpu():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env[cpu_attention.MARCH_ENV] = "x86-64-v3"
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=900)
    assert probe.returncode == 0, probe.stderr[-3000:]
    got = json.loads(probe.stdout.strip().splitlines()[-1])
    # the AVX2 kernels, chosen as on an AVX2 CPU: fp32 and bf16 weights on fma, not oneDNN
    assert got == {"dpbf16": False, "avx512_f32": False, "fma": True, "d96": True, "attention": "AVX2",
                   "fp32_on_fma": True, "bf16_own": None, "onednn_bf16": False}
    # the op tests, and the engine's fast paths (these ops, bf16 weights on fma) against transformers
    tests = [str(REPO / "tests" / name) for name in
             ("test_cpu_attention.py", "test_cpu_gemm.py", "test_families.py::test_family_fast_paths_pass_the_top5_rule")]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) >= 300, r.stdout[-2000:]  # the AVX-512-only tests skip; the rest run


# (target, the sources with branches for it that the native build may not compile, an instruction
# their assembly must hold, ones it must not, a flag of this CPU under which the native build
# compiles those branches already): AVX-512 with bf16 dot products (Cooper Lake, as Zen 4/5 have
# them; every source, vdpbf16ps in the GEMM), AMX (only gemm_cpu.cpp has AMX code; its tile dot
# product), and no AVX at all (the generic loops of every source; no ymm or zmm registers).
# At -O0: the checks hold there as at -O3 (intrinsics are always_inline, so one that the target
# lacks still fails to inline; each still emits its instruction), in half the compile time. The
# sources compile as one translation unit that includes each in turn: torch's headers, most of a
# compile's time, are then parsed once per target, not once per source (all four for x86-64-v2:
# 7 s against 25 s one by one). The native build compiles each source on its own, so a source
# that leans on another's includes still fails there.
ALL = [p.name for p in cpu_attention._SOURCES]
TARGETS = [("cooperlake", ALL, "vdpbf16ps", (), "avx512_bf16"),
           ("sapphirerapids", ["gemm_cpu.cpp"], "tdpbf16ps", (), "amx_bf16"),
           ("x86-64-v2", ALL, None, ("%ymm", "%zmm"), None)]


@needs_compiler
@pytest.mark.parametrize("target,sources,needs,refuses,native", TARGETS, ids=[t[0] for t in TARGETS])
def test_the_sources_compile_for_targets_this_cpu_may_not_have(target, sources, needs, refuses, native, tmp_path):
    if native in workload._cpuinfo()[1]:
        pytest.skip(f"this CPU has {native}: the native build compiles these branches")
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in include_paths()]
    flags = [f for f in cpu_attention.flags(target) if not f.startswith("-O")]
    unit = tmp_path / "sources.cpp"
    unit.write_text("".join(f'#include "{cpu_attention._CSRC / name}"\n' for name in sources))
    out = tmp_path / "sources.s"
    r = subprocess.run([COMPILER, *flags, "-O0", "-fPIC", "-w", *includes, "-DTORCH_EXTENSION_NAME=batchgen_cpu_ops",
                        "-S", str(unit), "-o", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{', '.join(sources)} for -march={target}:\n{r.stderr[-4000:]}"
    asm = out.read_text()
    assert needs is None or needs in asm, f"{', '.join(sources)} for -march={target} have no {needs}"
    assert not [x for x in refuses if x in asm], f"{', '.join(sources)} for -march={target} use {refuses}"
