"""The Python API: Engine(...).generate(requests) streams results as requests finish."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator

import torch

from .engine.kv_manager import KVCacheManager
from .engine.request import Request, SamplingParams
from .engine.scheduler import Scheduler, SchedulerConfig
from .errors import ConfigError
from .kernels import cpu_attention
from .runner.linear import onednn_available
from .runner.model import CausalLM, ModelShape
from .runner.model_runner import KVCache, ModelRunner, keep_freed_memory, kv_bytes_per_token_head

log = logging.getLogger("batchgen")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # KV budget in GiB; when None, kv_cache_fraction of free memory (capped at what the
    # batch can use: max_num_seqs sequences of max_model_len tokens).
    kv_cache_gib: float | None = None
    kv_cache_fraction: float = 0.25
    # Cap on prompt + output tokens; defaults to the model's context length.
    max_model_len: int | None = None
    prefix_caching: bool = True
    # Host-memory KV tier for swapped-out requests and spilled prefix blocks (0: off).
    cpu_offload_gib: float = 0.0
    # auto | swap | recompute: what a preempted request's KV becomes.
    preemption: str = "auto"
    dtype: str = "auto"
    # KV storage: "auto" (the model dtype), "int8" (per-token-head scales; CPU paths) or "fp8"
    # (e4m3, per-token-head scales; the Triton kernels on CUDA, the torch path on a CPU).
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    # "auto": oneDNN packed GEMMs on CPU when available; "plain": F.linear (exact reference).
    linear_path: str = "auto"
    # "batched" (padded, one SDPA for all decodes) or "exact" (per sequence, bit-identical
    # to transformers' batch-1 decode).
    decode_attention: str = "batched"
    # "auto": Triton kernels on CUDA; on a CPU the C++ decode op ("cpu") where it builds, else
    # "torch". "triton" on a CPU needs TRITON_INTERPRET=1.
    attention_backend: str = "auto"
    # Decode-only steps replay CUDA graphs captured per batch-size bucket (CUDA + Triton only).
    cuda_graphs: bool = True
    seed: int = 0
    # "throughput" (as configured) or "latency": caps the batch at LATENCY_MAX_SEQS sequences
    # and LATENCY_MAX_TOKENS tokens a step, trading throughput for low inter-token latency.
    profile: str = "throughput"
    # Waiting requests kept in the scheduler ahead of need, as a multiple of max_num_seqs.
    lookahead: int = 4
    # Longest prompt + max_tokens the caller will send; caps the default KV budget at what
    # max_num_seqs such sequences can use (a job knows it after tokenizing).
    max_seq_tokens: int | None = None


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class GenerationResult:
    request_id: str
    sample_index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    error: str | None
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None
    itl_s: float | None
    logprobs: list[tuple[float, dict[int, float]]]
    preemptions: int

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device: 'cuda' asked for but torch sees no CUDA device")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"model.device: {device!r} is not one of auto, cpu, cuda")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"model.dtype: {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def sliding_window(config) -> int | None:
    """The model's uniform sliding window (Mistral-style), or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None
    layers = getattr(config, "layer_types", None)
    if layers and any(t != "sliding_attention" for t in layers):
        raise ConfigError(f"model: mixed full/sliding attention layers ({config.model_type}) are not supported")
    return int(window)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 << 30


LATENCY_MAX_SEQS = 16
LATENCY_MAX_TOKENS = 512


class Engine:
    """Continuous batching on a paged KV cache. Build it from a model spec or a loaded
    transformers model; feed it GenerationRequests; results stream out as they finish."""

    def __init__(self, hf_model, tokenizer, config: EngineConfig | None = None, model_identity: str = "") -> None:
        cfg = config or EngineConfig()
        if cfg.profile not in ("throughput", "latency"):
            raise ConfigError(f"engine.profile: {cfg.profile!r} is not one of throughput, latency")
        if cfg.profile == "latency":
            cfg = replace(cfg, max_num_seqs=min(cfg.max_num_seqs, LATENCY_MAX_SEQS),
                           max_num_batched_tokens=min(cfg.max_num_batched_tokens, LATENCY_MAX_TOKENS))
        self.config = cfg
        self.tokenizer = tokenizer
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        linear_path = cfg.linear_path
        if linear_path == "auto":
            linear_path = "onednn" if self.device.type == "cpu" and onednn_available() else "plain"
        self.linear_path = linear_path
        if self.device.type == "cpu":
            keep_freed_memory()
        self.model = CausalLM(hf_model, self.dtype, str(self.device), linear_path)
        shape: ModelShape = self.model.shape
        self.max_model_len = min(cfg.max_model_len or shape.max_position, shape.max_position)
        self.window = sliding_window(hf_model.config)
        self.kv_dtype = self._kv_dtype(cfg.kv_cache_dtype)
        self.kv_bytes_per_token = 2 * shape.num_layers * shape.num_kv_heads * kv_bytes_per_token_head(
            self.kv_dtype, shape.head_dim)
        self.num_blocks = self._num_blocks(shape)
        block_bytes = cfg.block_size * self.kv_bytes_per_token
        self.num_cpu_blocks = int(cfg.cpu_offload_gib * 2**30) // block_bytes
        self.kv_cache = KVCache(shape.num_layers, self.num_blocks, cfg.block_size, shape.num_kv_heads,
                                shape.head_dim, self.kv_dtype, self.device, self.num_cpu_blocks)
        salt = f"{model_identity}|{self.dtype}|{self.kv_dtype}".encode()
        self.kv_manager = KVCacheManager(self.num_blocks, cfg.block_size, cfg.prefix_caching, salt,
                                         self.num_cpu_blocks, self.window)
        # Cost estimates for swap-or-recompute: host copies run ~10 GB/s on a CPU and ~20 GB/s
        # over PCIe; recompute costs 2 FLOP per parameter per token at ~150 GFLOP/s (this CPU,
        # measured) or ~300 TFLOP/s (H200 bf16, derated).
        flops = 1.5e11 if self.device.type == "cpu" else 3e14
        copy_bw = 1e10 if self.device.type == "cpu" else 2e10
        sched_cfg = SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len, cfg.preemption,
                                    recompute_s_per_token=2 * shape.non_embedding_params() / flops,
                                    swap_s_per_block=2 * block_bytes / copy_bw)
        self.scheduler = Scheduler(sched_cfg, self.kv_manager)
        backend = cfg.attention_backend
        if backend not in ("auto", "torch", "cpu", "triton"):
            raise ConfigError(f"engine.attention_backend: {backend!r} is not one of auto, torch, cpu, triton")
        fp8 = self.kv_dtype == torch.float8_e4m3fn
        if backend == "auto":
            if self.device.type == "cuda":
                backend = "triton"
            else:  # the C++ op reads float, bf16 and int8 caches; fp8 on a CPU stays on torch
                backend = "cpu" if not fp8 and cpu_attention.available() else "torch"
        elif backend == "cpu":
            if self.device.type != "cpu":
                raise ConfigError("engine.attention_backend: cpu runs on the CPU device only")
            if fp8:
                raise ConfigError("engine.kv_cache_dtype: fp8 is for CUDA (Triton kernels); on a CPU use int8, or "
                                  "engine.attention_backend: torch")
            try:
                cpu_attention.load()
            except RuntimeError as e:
                raise ConfigError(f"engine.attention_backend: cpu: {e}") from e
        if backend == "triton" and self.kv_dtype == torch.int8:
            raise ConfigError("engine.kv_cache_dtype: int8 runs on the CPU paths; on CUDA use fp8, or set "
                              "engine.attention_backend: torch")
        self.attention_backend = backend
        # The C++ fused layer ops ride along with the C++ attention op, except on the exact
        # reference paths (linear_path plain, decode_attention exact), which keep torch's ops.
        self.model.fused = backend == "cpu" and linear_path != "plain" and cfg.decode_attention == "batched"
        self.runner = ModelRunner(self.model, self.kv_cache, cfg.decode_attention, cfg.seed, backend, self.window)
        self.runner.sampler.fused_argmax = self.model.fused
        if cfg.cuda_graphs and backend == "triton" and self.device.type == "cuda":
            from .runner.cuda_graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(self.model, self.kv_cache.layers, self.scheduler.config.max_num_seqs,
                                              -(-self.max_model_len // cfg.block_size), self.window)
        self.eos_token_ids = self._eos_ids(hf_model, tokenizer)
        log.info("engine: %s %s, linear=%s, attention=%s%s, KV cache %d blocks x %d tokens = %.2f GiB (%d B/token), "
                 "CPU tier %d blocks = %.2f GiB", self.device, str(self.dtype).replace("torch.", ""), linear_path,
                 backend, " + fused layer ops" if self.model.fused else "",
                 self.num_blocks, cfg.block_size, self.kv_cache.bytes / 2**30, self.kv_bytes_per_token,
                 self.num_cpu_blocks, self.kv_cache.cpu_bytes / 2**30)
        self.step_count = 0

    def _kv_dtype(self, name: str) -> torch.dtype:
        if name == "auto":
            return self.dtype
        if name == "int8":
            return torch.int8
        if name == "fp8":
            return torch.float8_e4m3fn
        raise ConfigError(f"engine.kv_cache_dtype: {name!r} is not one of auto, int8, fp8")

    @classmethod
    def from_model(cls, spec: str, config: EngineConfig | None = None) -> "Engine":
        from .models.loader import load_hf_model, load_tokenizer, resolve_model

        source = resolve_model(spec)
        hf_model = load_hf_model(source)
        return cls(hf_model, load_tokenizer(source), config, model_identity=source.identity)

    def _num_blocks(self, shape: ModelShape) -> int:
        cfg = self.config
        per_block = cfg.block_size * self.kv_bytes_per_token
        if cfg.kv_cache_gib is not None:
            budget = int(cfg.kv_cache_gib * 2**30)
        else:
            budget = int(cfg.kv_cache_fraction * available_memory_bytes(self.device))
            longest = min(cfg.max_seq_tokens or self.max_model_len, self.max_model_len)
            useful = cfg.max_num_seqs * (-(-longest // cfg.block_size) + 1) * per_block
            budget = min(budget, useful)
        blocks = budget // per_block
        if blocks < 1:
            raise ConfigError(f"engine.kv_cache_gib: {budget} bytes hold no {per_block}-byte block; raise it")
        return blocks

    @staticmethod
    def _eos_ids(hf_model, tokenizer) -> tuple[int, ...]:
        ids = set()
        for src in (getattr(hf_model, "generation_config", None), hf_model.config):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(e, int):
                ids.add(e)
            elif e:
                ids.update(e)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # -- generation ------------------------------------------------------------------------

    def generate(self, requests: Iterable[GenerationRequest], should_stop=None,
                 grace_s: float = 0.0) -> Iterator[GenerationResult]:
        """Run every request; yield each result (one per sample) as soon as it finishes.
        should_stop() is asked before every step; once it says yes, nothing new is admitted,
        running requests get up to grace_s seconds to finish, and the rest are dropped."""
        pending = iter(requests)
        exhausted = False
        sched = self.scheduler
        target = self.config.max_num_seqs * self.config.lookahead
        deadline = None
        while True:
            if deadline is None and should_stop is not None and should_stop():
                deadline = time.monotonic() + grace_s
                sched.admitting = False
                log.info("stop requested: draining %d running requests for up to %.0fs", len(sched.running), grace_s)
            if deadline is not None:
                if not sched.running or time.monotonic() >= deadline:
                    return
                yield from self.step()
                continue
            while not exhausted and len(sched.waiting) < target:
                req = next(pending, None)
                if req is None:
                    exhausted = True
                else:
                    self.add_request(req)
            if not sched.has_unfinished():
                if exhausted:
                    return
                continue
            yield from self.step()

    def add_request(self, req: GenerationRequest) -> None:
        sp = req.sampling
        now = time.perf_counter()
        for i in range(sp.n):
            child_sp = sp
            if sp.n > 1:
                child_sp = replace(sp, n=1, seed=None if sp.seed is None else sp.seed + i)
            r = Request(f"{req.request_id}\x00{i}", list(req.prompt_token_ids), child_sp, self.eos_token_ids, now)
            self.scheduler.add_request(r)

    def step(self) -> list[GenerationResult]:
        sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute(sched_out.seqs, sched_out.copy_to_cpu, sched_out.copy_to_device)
        touched = self.scheduler.update(sched_out, runner_out)
        self.step_count += 1
        results = []
        for req in touched:
            text = None
            if req.sampling.stop and not req.is_finished:
                text = self._check_stop_strings(req)
            if req.is_finished:
                results.append(self._result(req, text))
        return results

    def _check_stop_strings(self, req: Request) -> str | None:
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        tail_from = max(0, len(text) - max(len(s) for s in req.sampling.stop) - 16)
        hits = [i for i in (text.find(s, tail_from) for s in req.sampling.stop) if i >= 0]
        if not hits:
            return None
        self.scheduler.finish_request(req.request_id, "stop")
        return text[: min(hits)]

    def _result(self, req: Request, text: str | None) -> GenerationResult:
        self.scheduler.release(req.request_id)
        if text is None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True) if req.output_token_ids else ""
        times = req.token_times
        ttft = times[0] - req.arrival_time if times else None
        itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        rid, _, idx = req.request_id.rpartition("\x00")
        return GenerationResult(rid, int(idx), text, list(req.output_token_ids), req.finish_reason or "error",
                                req.error, req.num_prompt_tokens, req.num_cached_tokens, ttft, itl, req.logprobs,
                                req.num_preemptions)

    def counters(self) -> dict:
        s = self.scheduler.stats
        t = self.kv_manager.tier
        return {
            "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""), "linear_path": self.linear_path,
            "attention_backend": self.attention_backend, "fused_layer_ops": self.model.fused,
            "cuda_graph_replays": self.runner.graphs.replays if self.runner.graphs else 0,
            "num_kv_blocks": self.num_blocks, "block_size": self.config.block_size,
            "kv_cache_bytes": self.kv_cache.bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_cache_dtype": str(self.kv_dtype).replace("torch.", ""),
            "max_model_len": self.max_model_len, "sliding_window": self.window, "profile": self.config.profile,
            "max_num_seqs": self.config.max_num_seqs, "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "steps": s.num_steps, "preemptions": s.num_preemptions,
            "prefill_tokens": s.prefill_tokens, "decode_tokens": s.decode_tokens, "peak_running": s.peak_running,
            "peak_kv_blocks": s.peak_kv_blocks, "prefix_hit_rate": round(self.kv_manager.prefix_hit_rate(), 4),
            "prefix_cache_evictions": self.kv_manager.pool.num_evictions,
            "preemptions_swap": s.num_swap_preemptions, "preemptions_recompute": s.num_recompute_preemptions,
            "cpu_kv_blocks": self.num_cpu_blocks, "cpu_kv_bytes": self.kv_cache.cpu_bytes,
            "peak_cpu_kv_blocks": self.kv_manager.cpu_pool.peak_used if self.kv_manager.cpu_pool else 0,
            "swapped_out_blocks": t.swapped_out_blocks, "swapped_in_blocks": t.swapped_in_blocks,
            "swapped_out_bytes": t.swapped_out_blocks * self.kv_cache.block_bytes,
            "swapped_in_bytes": t.swapped_in_blocks * self.kv_cache.block_bytes,
            "prefix_blocks_spilled": t.spilled_blocks, "prefix_blocks_reloaded": t.reloaded_blocks,
        }
