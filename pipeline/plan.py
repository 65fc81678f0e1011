"""`batchgen plan`: memory arithmetic from a model config alone (no weights).

weights = parameters x dtype bytes; KV per token = 2 (K and V) x layers x KV heads x head_dim x
dtype bytes (batchgen.shapes). For Llama 3 70B in bf16 that is ~141 GB of weights and 320 KiB
per token, so one 128k-token sequence needs 40 GiB of KV. For a job, dtype, device and the KV
budget are resolved by the run's own functions (batchgen.runner.build), so the plan is the run's.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import ConfigError
from .shapes import KV_DTYPE_BYTES, ModelShape, cdiv, kv_bytes_per_token

DTYPE_BYTES = KV_DTYPE_BYTES


def shape_from_config(cfg: dict, name: str = "model") -> ModelShape:
    try:
        return ModelShape.from_config(cfg)
    except KeyError as e:
        raise ConfigError(f"{name}: config lacks {e.args[0]!r}; a decoder config.json is needed") from None


def load_model_config(path: str) -> tuple[dict, str]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if p.suffix == ".json" and p.is_file():
        return json.loads(p.read_text()), str(p)
    from .models.loader import load_config, resolve_model

    source = resolve_model(path)
    return load_config(source).to_dict(), source.identity


def plan(shape: ModelShape, dtype: str, kv_budget_bytes: int, seq_tokens: int, batch: int | None = None,
         max_num_seqs: int | None = None, block_size: int = 16, avg_prompt: int | None = None,
         kv_dtype: str | None = None, name: str = "model", budget_source: str | None = None) -> dict:
    """How many sequences of seq_tokens fit the KV budget, and what to set."""
    kv_dtype = kv_dtype or dtype
    per_tok = kv_bytes_per_token(shape, kv_dtype)
    window = shape.sliding_window
    # Each layer keeps the whole sequence, or its window's blocks (Mistral: every layer; Gemma:
    # the sliding ones, while the full-attention layers keep everything).
    sliding = sum(1 for w in shape.layer_windows if w)
    kept = [min(seq_tokens, w) if w else seq_tokens for w in shape.layer_windows]
    per_seq = sum(cdiv(k, block_size) * block_size for k in kept) * (per_tok // shape.num_layers)
    fits = kv_budget_bytes // per_seq if per_seq else 0
    suggest_seqs = max(1, min(256, fits))
    suggest_tokens = max(2048, min(16384, (avg_prompt or seq_tokens // 2) + suggest_seqs))
    weights = shape.num_params() * DTYPE_BYTES[dtype]
    out = {"model": name, "params": shape.num_params(), "dtype": dtype, "kv_dtype": kv_dtype,
           **({"experts": shape.num_experts, "experts_per_token": shape.experts_per_token,
               "active_params": shape.non_embedding_params()} if shape.num_experts else {}),
           "weight_bytes": weights, "weight_gb": round(weights / 1e9, 1),
           "kv_bytes_per_token": per_tok, "kv_kib_per_token": round(per_tok / 1024, 1),
           "seq_tokens": seq_tokens, "kv_bytes_per_seq": per_seq, "kv_gib_per_seq": round(per_seq / 2**30, 2),
           "kv_budget_gib": round(kv_budget_bytes / 2**30, 2), "kv_budget_source": budget_source,
           "seqs_that_fit": fits, "suggested_max_num_seqs": suggest_seqs if fits else None,
           "suggested_max_num_batched_tokens": suggest_tokens, "sliding_window": window,
           "layers_full": shape.num_layers - sliding, "layers_sliding": sliding, "warnings": []}
    if window and seq_tokens > window:
        which = "" if sliding == shape.num_layers else f" of the {sliding} sliding layers"
        out["warnings"].append(f"sliding window {window}: KV per sequence{which} is bounded by the window")
    if fits == 0:
        out["warnings"].append(
            f"no sequence of {seq_tokens} tokens fits: it needs {per_seq / 2**30:.2f} GiB of KV and the budget is "
            f"{kv_budget_bytes / 2**30:.2f} GiB. Raise engine.kv_cache_gib to at least "
            f"{per_seq / 2**30 * 1.05:.2f}, lower engine.max_model_len or sampling.max_tokens, or set "
            "engine.kv_cache_dtype int8 (CPU) / fp8 (CUDA)")
    if batch is not None:
        need = batch * per_seq
        out["batch"] = batch
        out["kv_gib_for_batch"] = round(need / 2**30, 2)
        if need > kv_budget_bytes:
            out["warnings"].append(f"batch {batch} needs {need / 2**30:.1f} GiB of KV, over the "
                                   f"{kv_budget_bytes / 2**30:.1f} GiB budget")
    if max_num_seqs is not None and 0 < fits < max_num_seqs:
        out["warnings"].append(
            f"max_num_seqs {max_num_seqs} exceeds the {fits} sequences of {seq_tokens} tokens the KV budget holds: "
            f"expect constant preemption (thrashing); set max_num_seqs <= {fits} or raise the budget")
    return out


def plan_job(spec, sample_rows: int | None = None) -> dict:
    """The plan of a job as `run` would size it: its model, resolved device, dtype and KV dtype,
    its KV budget (engine.kv_cache_gib, else the fraction of this machine's free memory), and the
    longest prompt + max_tokens of its first window of rows."""
    import numpy as np

    from .job.prepare import prepare_job
    from .runner import build

    job = prepare_job(spec)
    cfg = load_model_config(str(job.model.folder))[0]
    shape = shape_from_config(cfg, job.model.identity)
    device = build.resolve_device(spec.model.device)
    dtype = build.resolve_dtype(spec.model.dtype, device)
    kv = build.resolve_kv_dtype(spec.engine.kv_cache_dtype, dtype)
    engine = build.apply_profile(spec.engine)
    keep = np.arange(min(len(job.index), sample_rows or spec.input.window_rows), dtype=np.int64)
    lens, prompts = [], []
    for w in job.windows(keep, background=False):
        lens += [len(r.token_ids) + r.sampling.max_tokens for r in w.rows]
        prompts += [len(r.token_ids) for r in w.rows]
    longest = max(lens, default=job.max_len)
    budget, source = build.kv_budget(engine, shape, kv, device, job.max_len)  # as the run sizes it
    p = plan(shape, build.dtype_name(dtype), budget, longest, None, engine.max_num_seqs,
             engine.block_size, sum(prompts) // max(len(prompts), 1) or None, build.dtype_name(kv),
             name=job.model.identity, budget_source=source)
    p["device"] = device.type
    p["rows_sampled"] = len(prompts)
    free = build.available_memory_bytes(device)
    if p["weight_bytes"] + budget > free and device.type == "cpu":
        p["warnings"].append(f"weights ({p['weight_gb']} GB) and KV ({budget / 2**30:.1f} GiB) exceed "
                             f"the {free / 2**30:.1f} GiB of free memory")
    return p


def format_plan(p: dict) -> str:
    experts = (f"; {p['experts']} experts, {p['experts_per_token']} per token: "
               f"{p['active_params'] / 1e9:.2f} B non-embedding parameters active" if p.get("experts") else "")
    lines = [f"model: {p['model']} ({p['params'] / 1e9:.2f} B parameters{experts}), dtype {p['dtype']}"
             + (f" on {p['device']}" if p.get("device") else ""),
             f"weights: {p['weight_gb']} GB",
             f"KV per token ({p['kv_dtype']}): {p['kv_kib_per_token']} KiB; per sequence of {p['seq_tokens']} tokens: "
             f"{p['kv_gib_per_seq']} GiB"]
    if p.get("layers_sliding"):
        lines.append(f"layers: {p['layers_full']} full attention, {p['layers_sliding']} sliding (window "
                     f"{p['sliding_window']}, keeping only the window's KV)")
    if p.get("rows_sampled") is not None:
        lines.append(f"sequence length: the longest prompt + max_tokens of the first {p['rows_sampled']} rows")
    if "batch" in p:
        lines.append(f"batch {p['batch']}: {p['kv_gib_for_batch']} GiB of KV")
    lines.append(f"KV budget {p['kv_budget_gib']} GiB" + (f" ({p['kv_budget_source']})" if p.get("kv_budget_source")
                                                          else "") + f" holds {p['seqs_that_fit']} such sequences")
    if p["suggested_max_num_seqs"]:
        lines.append(f"suggested: max_num_seqs {p['suggested_max_num_seqs']}, "
                     f"max_num_batched_tokens {p['suggested_max_num_batched_tokens']}")
    lines += [f"warning: {w}" for w in p["warnings"]]
    return "\n".join(lines)
