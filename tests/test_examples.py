"""The benchmark scripts under examples/ that the README's tables come from: their pure parts."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import compare_vllm  # noqa: E402
import run_ladder  # noqa: E402


def test_repeats_alternate_which_engine_runs_first_and_pair_neighbours():
    calls = []

    def engine(name):
        def run():
            calls.append(name)
            return {"wall_s": 10.0 + len(calls), "load_s": 1.0, "output_tokens": 5, "peak_rss_bytes": len(calls)}
        return run

    vs, bs = compare_vllm.alternate(4, engine("vllm"), engine("batchgen"))
    assert calls == ["vllm", "batchgen", "batchgen", "vllm", "vllm", "batchgen", "batchgen", "vllm"]
    # pair i: vLLM's and batchgen's i-th runs, which ran back to back
    assert [v["wall_s"] for v in vs] == [11.0, 14.0, 15.0, 18.0]
    assert [b["wall_s"] for b in bs] == [12.0, 13.0, 16.0, 17.0]
    s = compare_vllm.summarize(vs)
    assert s["wall_s"] == 14.5 and s["peak_rss_bytes"] == 8 and s["output_tokens"] == 5


def test_one_repeat_runs_vllm_then_batchgen_once():
    calls = []
    vs, bs = compare_vllm.alternate(1, lambda: calls.append("v") or {"wall_s": 1.0},
                                    lambda: calls.append("b") or {"wall_s": 2.0})
    assert calls == ["v", "b"] and len(vs) == len(bs) == 1


def _row(**kw):
    row = {"model": "qwen2.5-0.5b", "workload": "decode-heavy", "dtype": "bfloat16", "requests": 128,
           "prompt_tokens": 16107, "output_tokens": 24353, "vllm_output_tok_s": 405.7, "batchgen_output_tok_s": 398.7,
           "vllm_wall_s": 60.0, "batchgen_wall_s": 61.1, "ratio_batchgen_over_vllm": 0.982, "vllm_peak_rss_gib": 5.91,
           "batchgen_peak_rss_gib": 1.85, "vllm_load_s": 76.8, "batchgen_load_s": 7.8}
    row.update(kw)
    return row


def test_ladder_table_shows_the_median_and_each_pair_ratio_of_repeated_rows():
    table = run_ladder.render([_row(), _row(ratio_batchgen_over_vllm=1.04, repeats=3, pair_ratios=[0.98, 1.09, 1.04]),
                               _row(workload="prefill-only")])
    lines = table.splitlines()
    assert len(lines) == 5
    assert "| **0.98** |" in lines[2] and "405.7 tok/s" in lines[2]
    assert "| **1.04** (0.98, 1.09, 1.04) |" in lines[3]
    assert "| 60.0 s | 61.1 s |" in lines[4]  # prefill-only rows report wall seconds


def test_ab_batchgen_exports_a_revision_as_an_importable_package(tmp_path):
    """The B side of examples/ab_batchgen.py: HEAD's pipeline/ and kernels/ as batchgen and
    batchgen.kernels, file for file."""
    import subprocess

    import ab_batchgen

    root = Path(__file__).resolve().parents[1]
    if subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        import pytest

        pytest.skip("not a git checkout")
    pkg = ab_batchgen.export_revision("HEAD", tmp_path) / "batchgen"
    tracked = subprocess.run(["git", "-C", str(root), "ls-files", "pipeline", "kernels"], capture_output=True,
                             text=True, check=True).stdout.split()
    want = sorted(f.replace("pipeline/", "", 1) if f.startswith("pipeline/") else f for f in tracked)
    got = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*") if p.is_file())
    assert got == want
    head = subprocess.run(["git", "-C", str(root), "show", "HEAD:kernels/csrc/gemm_cpu.cpp"], capture_output=True,
                          check=True).stdout
    assert (pkg / "kernels" / "csrc" / "gemm_cpu.cpp").read_bytes() == head


def test_ab_gemm_source_takes_a_revisions_sources_and_renames_their_op_library():
    """examples/ab_gemm_source.py builds gemm_cpu.cpp at a revision beside the working tree's: each
    must register under its own name, and a revision git does not know stops with its name."""
    import subprocess

    import ab_gemm_source
    import pytest

    root = Path(__file__).resolve().parents[1]
    if subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    files = ab_gemm_source.sources_at("HEAD")
    head = subprocess.run(["git", "-C", str(root), "show", "HEAD:kernels/csrc/gemm_cpu.cpp"], capture_output=True,
                          text=True, check=True).stdout
    assert files["gemm_cpu.cpp"] == head and "inline" in files["cpu_common.h"]
    src = ab_gemm_source.renamed(head, "ab_base")
    assert "TORCH_LIBRARY_FRAGMENT(ab_base, m)" in src and "TORCH_LIBRARY_FRAGMENT(batchgen_cpu" not in src
    with pytest.raises(SystemExit, match="has 0 TORCH_LIBRARY_FRAGMENT"):
        ab_gemm_source.renamed("int x;", "ab_head")
    with pytest.raises(SystemExit, match="no-such-rev"):
        ab_gemm_source.sources_at("no-such-rev")


def test_gemm_rows_bench_alternates_the_paths_rep_by_rep(capsys):
    """bench_gemm_rows.measure runs the paths ABBA over the reps, so a burst of load on the machine
    lands on both, and ends with each path's layer speed over the first path's."""
    import bench_gemm_rows
    import torch

    order = []

    def linear(path):
        def call(x):
            order.append(path)
            return x
        return call

    shapes = {"qkv": (4, 8), "o": (4, 4), "gate_up": (4, 16), "down": (8, 4), "lm_head": (4, 32)}
    layer = {k: v for k, v in shapes.items() if k != "lm_head"}
    linears = {p: ({k: [linear(p)] * 4 for k in layer}, linear(p)) for p in ("onednn", "fma")}
    bench_gemm_rows.measure(2, linears, shapes, layer, torch.float32, reps=3)
    per_rep = 4 * len(layer) + 1  # four copies of the layer's linears, then the lm_head
    runs = [order[i] for i in range(0, len(order), per_rep)]
    assert len(order) == 2 * 4 * per_rep
    assert runs == ["onednn", "fma", "fma", "onednn", "onednn", "fma", "fma", "onednn"]
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out[:2]] == ["onednn", "fma"]
    assert out[2].startswith("     2 layer speed over onednn's: fma ")


def test_ab_gemm_source_picks_the_avx2_kernels_where_the_build_has_no_avx512():
    import ab_gemm_source
    import pytest

    class Lib:
        def __init__(self, **has):
            for name in ("has_dpbf16_gemm", "has_avx512_f32_gemm", "has_fma_bf16_gemm"):
                setattr(self, name, (lambda v: lambda: v)(has.get(name, False)))

    zen3 = {"base": Lib(has_fma_bf16_gemm=True), "head": Lib(has_fma_bf16_gemm=True)}
    zen4 = {v: Lib(has_fma_bf16_gemm=True, has_avx512_f32_gemm=True, has_dpbf16_gemm=True) for v in ("base", "head")}
    assert ab_gemm_source.pick_kernel("auto", False, zen3) == "fma"
    assert ab_gemm_source.pick_kernel("auto", True, zen4) == "avx512"
    assert ab_gemm_source.pick_kernel("fma", False, zen4) == "fma"
    with pytest.raises(SystemExit, match="no AVX-512 GEMM"):
        ab_gemm_source.pick_kernel("avx512", False, zen3)
    with pytest.raises(SystemExit, match="no AVX2/FMA GEMM"):
        ab_gemm_source.pick_kernel("fma", True, {"base": Lib(), "head": Lib()})


def test_ab_attention_source_renames_the_attention_library_and_reads_its_cases():
    """examples/ab_attention_source.py builds paged_attention_cpu.cpp (decode, TORCH_LIBRARY) or
    prefill_attention_cpu.cpp (--op prefill, a FRAGMENT) under its own op library per build, and
    reads its cases as NxL or mixed (decode: 256 contexts of 50-1,199 tokens; prefill: 64 prompts
    of 16-512)."""
    import ab_attention_source as aa
    import ab_gemm_source
    import pytest
    import torch

    for op, lib in (("decode", "TORCH_LIBRARY"), ("prefill", "TORCH_LIBRARY_FRAGMENT")):
        source, marker = aa.SOURCES[op]
        src = (Path(__file__).resolve().parents[1] / "kernels" / "csrc" / source).read_text()
        out = ab_gemm_source.renamed(src, "ab_x", source, marker)
        assert f"{lib}(ab_x, m)" in out and f"{lib}(batchgen_cpu" not in out
        assert f"paged_{op}(" in out
    g = torch.Generator().manual_seed(0)
    assert aa.lengths("3x7", g) == [7, 7, 7]
    mixed = aa.lengths("mixed", g)
    assert len(mixed) == 256 and 50 <= min(mixed) and max(mixed) < 1200
    prompts = aa.lengths("mixed", g, "prefill")
    assert len(prompts) == 64 and 16 <= min(prompts) and max(prompts) <= 512
    with pytest.raises(SystemExit, match="neither NxL"):
        aa.lengths("big", g)


def test_profile_engine_groups_op_time_by_the_first_inputs_row_count():
    from types import SimpleNamespace as E

    import profile_engine

    assert [profile_engine.row_bucket([[n, 8]]) for n in (1, 2, 16, 17, 64, 65, 256, 257, 1024, 1025)] == [
        "1", "2-16", "2-16", "17-64", "17-64", "65-256", "65-256", "257-1024", "257-1024", ">1024"]
    assert profile_engine.row_bucket([[], [], [40, 3]]) == "17-64"  # the first input that is a tensor
    assert profile_engine.row_bucket([[], []]) == ""
    g = "batchgen_cpu::gemm_f32_avx512"  # (out [M, N or N / 2], x [M, K], packed [N / 16, K, 16], bias, act)
    events = [E(key=g, input_shapes=[[32, 48], [32, 8], [3, 8, 16], [], []], self_cpu_time_total=10.0, count=2),
              E(key=g, input_shapes=[[20, 24], [20, 8], [3, 8, 16], [], []], self_cpu_time_total=5.0, count=1),
              E(key=g, input_shapes=[[256, 48], [256, 8], [3, 8, 16], [], []], self_cpu_time_total=40.0, count=1),
              E(key="aten::empty", input_shapes=[], self_cpu_time_total=1.0, count=7)]
    assert profile_engine.group_by_rows(events) == {
        (g, "17-64"): [15.0, 3, 2 * (2 * 32 * 8 * 48) + 2 * 20 * 8 * 48], (g, "65-256"): [40.0, 1, 2 * 256 * 8 * 48],
        ("aten::empty", ""): [1.0, 7, 0]}
