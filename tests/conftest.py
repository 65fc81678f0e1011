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

REPO = Path(__file__).resolve().parent.parent


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
