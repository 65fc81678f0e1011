"""batchgen against itself at another git revision, on one ladder workload: fresh processes in
alternating order, B A A B ... (A = the installed batchgen, B = REV), only `Engine.generate`
timed, as compare_vllm.py times it: the README's "ABBA" figures for a code change.

    .venv/bin/python examples/ab_batchgen.py --base HEAD~1 --model /tmp/ladder/llama-3-8b \
        --workload prompt-heavy --num-prompts 16 --output-cap 32 [--dtype bfloat16] [--rounds 2]

REV's `pipeline/` and `kernels/` are exported with `git archive` into a temporary `batchgen`
package that goes first on B's PYTHONPATH (its C++ ops build on first use, like a checkout's).
Prints each run's wall seconds and the B / A wall ratio of each pair (above 1: A is faster).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_vllm import BATCHGEN_RUNNER, alternate, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def export_revision(rev: str, dest: Path, repo: Path = ROOT) -> Path:
    """REV's pipeline/ and kernels/ as an importable `batchgen` package under dest; returns dest."""
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "pipeline", "kernels"], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"git archive {rev}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    (dest / "pipeline").rename(dest / "batchgen")
    (dest / "kernels").rename(dest / "batchgen" / "kernels")
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the git revision B runs (A is the installed batchgen)")
    ap.add_argument("--model", required=True, help="a local HF folder or GGUF file")
    ap.add_argument("--workload", default="prompt-heavy")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-cap", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=2, help="pairs; each engine runs this many times")
    args = ap.parse_args()

    from batchgen.models.loader import load_tokenizer, resolve_model
    from batchgen.workload import sample_workload

    items = sample_workload(args.workload, load_tokenizer(resolve_model(args.model)), args.num_prompts,
                            args.output_cap)
    spec = {"model_spec": args.model, "dtype": args.dtype, "prompts": [w.prompt_token_ids for w in items],
            "output_lens": [w.output_len for w in items]}
    print(f"{args.workload}: {len(items)} requests, {sum(map(len, spec['prompts']))} prompt / "
          f"{sum(spec['output_lens'])} output tokens", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="batchgen-ab-"))
    try:
        base = export_revision(args.base, tmp)
        env_a = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env_b = dict(env_a, PYTHONPATH=str(base))

        def side(name, env):
            def go():
                out = run(sys.executable, BATCHGEN_RUNNER, spec, env)
                print(f"{name} {out['wall_s']:.2f} s (load {out['load_s']:.1f} s)", flush=True)
                return out
            return go

        # alternate() runs its first argument first on even rounds: B (base), A, A, B, ...
        bs, as_ = alternate(args.rounds, side("B", env_b), side("A", env_a))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    pairs = [b["wall_s"] / a["wall_s"] for a, b in zip(as_, bs)]
    print(json.dumps({"a_wall_s": [a["wall_s"] for a in as_], "b_wall_s": [b["wall_s"] for b in bs],
                      "b_over_a": [round(p, 3) for p in pairs], "median": round(statistics.median(pairs), 3)}))


if __name__ == "__main__":
    main()
