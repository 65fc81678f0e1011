from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Child Pythons (`python -m batchgen` from the checkout) keep the working directory off sys.path:
# the checkout's kernels/ would shadow PyPI's `kernels`, which transformers imports.
os.environ.setdefault("PYTHONSAFEPATH", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run on this CPU through the interpreter; examples/gpu_check.py sets 0 on CUDA.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs 2 workers) each worker takes its share of the cores, so
# the workers' torch threads do not contend; most tests are single-threaded Python anyway.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from helpers import tiny_hf_model


def _speed_up_the_triton_interpreter() -> None:
    """Two costs of Triton's interpreter (3.x) that buy these tests nothing, about half of a kernel's
    interpreted time. On one Zen 3 core: the Gemma 3 Triton test ran 58-75 s, 49-52 s without the
    first, 41-45 s without both; test_kernels.py 203 s, and 91 s without both.
    - It re-patches triton.language at every call of a @triton.jit function inside a kernel (tl.sum
      and tl.max included): inspect.getmembers() walks of the language modules and the tensor class,
      ~3 ms a call. Here each language module is patched once, at the first launch or call that
      needs it, and stays patched: Triton itself never undoes a call's patches either.
    - It checks every int32 add, sub and mul for overflow (sanitize_overflow, which compiled kernels
      do only in debug mode) by redoing it in int64. Our test shapes keep offsets far below 2**31, so
      the check cannot fire here; offsets at real sizes are the kernels' own int64 casts' job.
    The kernels run the same interpreted code either way."""
    try:
        import dataclasses
        import inspect

        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    builder = getattr(interpreter, "interpreter_builder", None)
    if patch is None or not hasattr(interpreter, "_LangPatchScope") or builder is None:
        return  # another Triton: leave its interpreter alone

    def langs(fn):
        return {id(v) for v in getattr(fn, "__globals__", {}).values() if inspect.ismodule(v)
                and v.__name__.startswith("triton.language")}

    patched: set = set()

    def patch_once(fn):
        if not (needed := langs(fn)) <= patched:
            patch(fn)
            patched.update(needed)
        return interpreter._LangPatchScope()  # nothing to undo

    interpreter._patch_lang = patch_once
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and hasattr(options, "sanitize_overflow"):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


if os.environ.get("TRITON_INTERPRET") == "1":
    _speed_up_the_triton_interpreter()

REPO = Path(__file__).resolve().parent.parent

# The heaviest modules first, so that `make test`'s two xdist workers (--dist loadscope: a module
# each at a time) finish together: longest-first list scheduling. Without it xdist queues modules
# by their number of tests, and the few-test heavy ones (ray, the 1B loader, the sliding window's
# Triton run) ran last with one worker idle: 755 s of wall for 1,328 s of tests, against 547 s for
# 1,050 s with this and the interpreter's savings above (stop 60, Zen 3). The Makefile passes
# --no-loadscope-reorder so xdist keeps this order. Seconds of one module then, on a 2-core Zen 3
# (`pytest --durations=0`); a module not named here runs after these in collection order. Order
# only: nothing depends on it.
HEAVY_FIRST = ("test_smollm2", "test_pipeline", "test_kv_quality", "test_kernels", "test_engine",  # 170-90 s
               "test_ray", "test_scale", "test_loader", "test_gemma", "test_cpu_march",  # 75-45 s
               "test_families", "test_robustness", "test_sliding_window", "test_inputs")  # 30-20 s


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module's own order holds


@pytest.fixture(scope="session")
def smol_source():
    """The bundled SmolLM2 (dequantised once into the batchgen cache)."""
    from batchgen.models.loader import ensure_local, resolve_model

    src = resolve_model("default")
    ensure_local(src)
    return src


@pytest.fixture(scope="session")
def smol_tokenizer(smol_source):
    from batchgen.models.loader import load_tokenizer

    return load_tokenizer(smol_source)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_tokenizer):
    """A local HF folder (safetensors) of a tiny random Llama with SmolLM2's real tokenizer."""
    d = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_hf_model("llama", vocab_size=len(smol_tokenizer), eos_token_id=2, max_position_embeddings=512)
    model.save_pretrained(d)
    smol_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def hf_model(smol_source):
    """The real SmolLM2 as a transformers model (fp32), once per test module."""
    from batchgen.models.loader import load_hf_model

    return load_hf_model(smol_source)
