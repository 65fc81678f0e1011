"""The streaming weight loader: HF folders (single and sharded safetensors) straight into the
runner's layout, equal to transformers; clear errors for broken checkpoints; bounded memory."""
import json
import subprocess
import sys

import pytest
import torch

from batchgen.engine.request import SamplingParams
from batchgen.errors import ConfigError
from batchgen.llm import Engine, GenerationRequest
from batchgen.models.loader import load_checkpoint, resolve_model
from batchgen.models.weights import save_safetensors_shards
from conftest import REPO
from helpers import engine_specs, tiny_hf_model
from test_engine import IdTokenizer, hf_greedy, prompts


def write_folder(model, folder, shard_bytes=1 << 30):
    """A HF folder of `model` written by our shard writer (sharded when shard_bytes is small)."""
    model.config.save_pretrained(folder)
    save_safetensors_shards(((k, v.detach().clone()) for k, v in model.state_dict().items()
                             if not (model.config.tie_word_embeddings and k == "lm_head.weight")), folder, shard_bytes)
    return folder


def folder_greedy(folder, ps, n_new):
    """Our greedy tokens for prompts ps from a model folder, on the exact reference paths."""
    ckpt = load_checkpoint(resolve_model(str(folder)))
    e = Engine(ckpt, IdTokenizer(), *engine_specs(kv_cache_gib=0.02, linear_path="plain", decode_attention="exact"))
    sp = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    got = {r.request_id: r.token_ids for r in e.generate(GenerationRequest(str(i), p, sp) for i, p in enumerate(ps))}
    return [got[str(i)] for i in range(len(ps))]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("shard_bytes", [1 << 30, 64 << 10], ids=["one-file", "sharded"])
def test_folder_loading_gives_transformers_greedy_tokens(tmp_path, family, shard_bytes):
    model = tiny_hf_model(family, seed=3)
    folder = write_folder(model, tmp_path / family, shard_bytes)
    if shard_bytes < 1 << 20:
        assert len(list(folder.glob("model-*.safetensors"))) > 3
    ps = prompts(seed=5)
    assert folder_greedy(folder, ps, 12) == hf_greedy(model, ps, 12)


def test_bf16_checkpoint_loads_into_fp32_and_bf16(tmp_path):
    model = tiny_hf_model("llama", seed=1).to(torch.bfloat16)
    folder = write_folder(model, tmp_path / "bf16")
    ckpt = load_checkpoint(resolve_model(str(folder)))
    for dtype in ("float32", "bfloat16"):
        e = Engine(ckpt, IdTokenizer(), *engine_specs(kv_cache_gib=0.02, dtype=dtype))
        assert e.model.embed.dtype == getattr(torch, dtype)
        assert torch.equal(e.model.embed.float(), model.model.embed_tokens.weight.float())


def _broken(tmp_path, how):
    folder = write_folder(tiny_hf_model("llama"), tmp_path / how, 64 << 10)
    shards = sorted(folder.glob("model-*.safetensors"))
    if how == "missing-shard":
        shards[1].unlink()
    elif how == "truncated":
        shards[2].write_bytes(shards[2].read_bytes()[:-100])
    elif how == "bad-header":
        shards[0].write_bytes(b"\xff" * 64)
    elif how == "wrong-shape":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["intermediate_size"] = 96
        (folder / "config.json").write_text(json.dumps(cfg))
    elif how == "missing-tensor":
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder, shards


@pytest.mark.parametrize("how,match", [
    ("missing-shard", r"index.json lists model-00002-of-\d+.safetensors, which is missing"),
    ("truncated", r"model-00003-of-\d+.safetensors: tensor '.*' ends at byte \d+, past the end .* truncated"),
    ("bad-header", r"model-00001-of-\d+.safetensors: not a readable safetensors file"),
    ("wrong-shape", r"safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape \[128, 64\]; .* needs \[96, 64\]"),
    ("missing-tensor", r"tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
])
def test_a_broken_checkpoint_names_the_file_and_tensor(tmp_path, how, match):
    folder, _ = _broken(tmp_path, how)
    with pytest.raises(ConfigError, match=match):
        Engine(load_checkpoint(resolve_model(str(folder))), IdTokenizer(), *engine_specs(kv_cache_gib=0.02))


def test_loading_a_1b_model_stays_within_its_weights_plus_1_gib(tmp_path):
    """Peak RSS while a ~1.07B-parameter bf16 checkpoint loads into the CPU runner in bf16 stays under
    the final weight bytes + 1 GiB above the process's size before loading."""
    sys.path.insert(0, str(REPO / "examples"))
    from make_model_ladder import make

    from batchgen.models.loader import load_tokenizer

    folder = make("llama-3.2-1b", tmp_path, load_tokenizer(resolve_model("default")))
    code = f"""
import torch
from batchgen.config import EngineSpec, ModelSpec
from batchgen.llm import Engine
from batchgen.models.loader import load_checkpoint, resolve_model
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096
base = rss()
e = Engine(load_checkpoint(resolve_model({str(folder)!r}), "bfloat16"), None,
           EngineSpec(kv_cache_gib=0.01, attention_backend="torch"), ModelSpec(dtype="bfloat16"))
weights = sum(p.numel() * p.element_size() for p in [e.model.embed, e.model.norm, e.model.cos, e.model.sin])
for l in e.model.layers:
    weights += sum(x.numel() * x.element_size() for x in [l.input_norm, l.post_norm])
    weights += 2 * (sum(lin.out_features * lin.in_features for lin in [l.qkv, l.o]) + l.mlp.num_weights())
# This process's own peak (VmHWM, of its address space): ru_maxrss would carry over the high-water
# mark of the pytest process it was forked from, as large as that process has grown.
peak = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')) * 1024
print(base, peak, weights, e.model.shape.num_layers)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    base, peak, weights, layers = (int(x) for x in out.stdout.split())
    assert weights > 2e9 and layers == 16
    assert peak - base <= weights + (1 << 30), (peak - base - weights) / 2**20


def test_a_ladder_phi3_folder_gives_transformers_greedy_tokens(tmp_path):
    """make_model_ladder's Phi-3 rung writes fused qkv_proj / gate_up_proj tensors, as Phi-3
    checkpoints do: at a tiny size of that layout (multi-head, 4 K/V heads), transformers and our
    loader read the same model."""
    sys.path.insert(0, str(REPO / "examples"))
    from make_model_ladder import LADDER, VOCAB, tensors
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = LADDER["phi-3-mini"]
    fields = {**fields, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4}
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, torch_dtype="bfloat16", **fields)
    folder = tmp_path / "phi3"
    config.save_pretrained(folder)
    save_safetensors_shards(tensors(config, seed=2), folder)
    names = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])
    assert {"model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"} <= names
    unfused = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".gate_proj.weight", ".up_proj.weight")
    assert not any(n.endswith(unfused) for n in names)
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ps = prompts(seed=6)
    assert folder_greedy(folder, ps, 8) == hf_greedy(hf, ps, 8)
