"""The Python API: Engine(...).generate(requests) streams results as requests finish."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from .config import EngineSpec, ModelSpec
from .engine.kv_manager import HybridKVManager, KVCacheManager
from .engine.request import Request, SamplingParams
from .engine.scheduler import Scheduler, SchedulerConfig
from .runner import build
from .runner.model import CausalLM
from .runner.model_runner import KVCache, ModelRunner, keep_freed_memory, release_freed_memory
from .runner.sampler import Sampler
from .shapes import ModelShape

log = logging.getLogger("batchgen")

# Waiting requests kept in the scheduler ahead of need, as a multiple of max_num_seqs.
LOOKAHEAD = 4

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
    # With sampling.prompt_logprobs: per prompt token after the first, (logprob, top-k).
    prompt_logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state and counters (progress lines, summaries)."""

    running: int
    waiting: int
    kv_usage: float
    prefix_hit_rate: float
    prefill_tokens: int
    decode_tokens: int
    generated_tokens: int
    preemptions: int
    swap_preemptions: int
    recompute_preemptions: int
    cpu_blocks_used: int
    cpu_blocks: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    spilled_blocks: int
    reloaded_blocks: int


class Engine:
    """Continuous batching on a paged KV cache. Build it from a model spec or a loaded
    transformers model; feed it GenerationRequests; results stream out as they finish."""

    def __init__(self, checkpoint, tokenizer, engine: EngineSpec | None = None, model: ModelSpec | None = None, *,
                 model_identity: str = "", max_seq_tokens: int | None = None, grammars=None, on_layer=None) -> None:
        """checkpoint: a models.weights.Checkpoint (models.loader.load_checkpoint), or a
        transformers model in memory. engine and model are the job spec's sections (validated
        pydantic models); max_seq_tokens is the longest prompt + max_tokens the caller will send,
        which caps the default KV budget; grammars: a guided.GrammarBook shared with whoever
        compiled the constraints already (made on first need otherwise); on_layer(i) is called as
        each layer's weights load."""
        from .models.weights import Checkpoint, eos_ids_of

        checkpoint = Checkpoint.of(checkpoint)
        self.config = spec = build.apply_profile(engine or EngineSpec())
        model = model or ModelSpec()
        self.tokenizer = tokenizer
        self.device = build.resolve_device(model.device)
        self.dtype = build.resolve_dtype(model.dtype, self.device)
        self.kv_dtype = build.resolve_kv_dtype(spec.kv_cache_dtype, self.dtype)
        self.backend = backend = build.choose_backend(spec, self.device, self.kv_dtype, self.dtype)
        def layer_loaded(i: int) -> None:
            release_freed_memory()
            if on_layer is not None:
                on_layer(i)

        self.model = CausalLM(checkpoint, self.dtype, str(self.device), backend.linear_path, backend.fused_ops,
                              layer_loaded, triton_ops=backend.triton_ops)
        # Kept freed memory serves the steps; set only now, so that loading returns what it frees.
        if self.device.type == "cpu":
            keep_freed_memory()
        shape: ModelShape = self.model.shape
        self.max_model_len = min(spec.max_model_len or shape.max_position, shape.max_position)
        # The sliding layers' window (every layer's in Mistral-style models), or None.
        self.window = shape.sliding_window
        self.kv_layout = kv = build.size_kv_cache(spec, shape, self.kv_dtype, self.device, self.max_model_len,
                                                  max_seq_tokens)
        self.kv_cache = KVCache(shape.num_layers, kv.num_blocks, spec.block_size, shape.num_kv_heads,
                                shape.head_dim, self.kv_dtype, self.device, kv.num_cpu_blocks, shape.layer_group,
                                kv.group_blocks)
        salt = f"{model_identity}|{self.dtype}|{self.kv_dtype}".encode()
        managers = [KVCacheManager(n, spec.block_size, spec.prefix_caching, salt, cpu, window)
                    for (n, cpu), window in zip(kv.group_blocks, shape.kv_groups)]
        self.kv_manager = managers[0] if len(managers) == 1 else HybridKVManager(managers)
        recompute_s, swap_s = build.preemption_costs(shape, kv.block_bytes, self.device)
        self.scheduler = Scheduler(SchedulerConfig(spec.max_num_seqs, spec.max_num_batched_tokens, self.max_model_len,
                                                   spec.preemption, recompute_s, swap_s), self.kv_manager)
        graphs = build.decode_graphs(spec, backend, self.device, self.model, self.kv_cache.layers, self.max_model_len,
                                     self.window)
        self.runner = ModelRunner(self.model, self.kv_cache, Sampler(spec.seed, fused_argmax=backend.fused_ops),
                                  spec.decode_attention, backend.attention, graphs=graphs, windows=shape.kv_groups)
        self.eos_token_ids = tuple(sorted(set(checkpoint.eos_token_ids).union(eos_ids_of(tokenizer))))
        self.grammars = grammars
        log.info("engine: %s %s, linear=%s, attention=%s%s, KV cache %s blocks x %d tokens = %.2f GiB (%d B/token), "
                 "CPU tier %d blocks = %.2f GiB", self.device, build.dtype_name(self.dtype), backend.linear_path,
                 backend.attention, f" + {backend.layer_ops} layer ops" if backend.layer_ops else "",
                 self._group_text(), spec.block_size, self.kv_cache.bytes / 2**30, kv.bytes_per_token,
                 kv.num_cpu_blocks, self.kv_cache.cpu_bytes / 2**30)
        self.step_count = 0

    @property
    def num_blocks(self) -> int:
        return self.kv_layout.num_blocks

    def _group_text(self) -> str:
        """The KV blocks, per group with hybrid KV: "4096 (full, 4 layers) + 1200 (window 512, 22 layers)"."""
        shape = self.model.shape
        if len(shape.kv_groups) == 1:
            return str(self.kv_layout.num_blocks)
        return " + ".join(f"{n} ({'window ' + str(w) if w else 'full'}, {shape.group_layers(g)} layers)"
                          for g, ((n, _), w) in enumerate(zip(self.kv_layout.group_blocks, shape.kv_groups)))

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_layout.bytes_per_token

    @classmethod
    def from_model(cls, model: str | ModelSpec = "default", engine: EngineSpec | None = None) -> "Engine":
        from .models.loader import load_checkpoint, load_tokenizer, resolve_model

        model = ModelSpec(path=model) if isinstance(model, str) else model
        source = resolve_model(model.path)
        dtype = build.dtype_name(build.resolve_dtype(model.dtype, build.resolve_device(model.device)))
        return cls(load_checkpoint(source, dtype), load_tokenizer(source), engine, model,
                   model_identity=source.identity)

    # -- generation ------------------------------------------------------------------------

    def generate(self, requests: Iterable[GenerationRequest], should_stop=None, grace_s: float = 0.0,
                 on_step=None) -> Iterator[GenerationResult]:
        """Run every request; yield each result (one per sample) as soon as it finishes.
        Requests are pulled from the iterable only as the scheduler needs them. should_stop() is
        asked before every step; once it says yes, nothing new is admitted, running requests get
        up to grace_s seconds to finish, and the rest are dropped. on_step(engine) is called after
        every step (progress, signal checks)."""
        pending = iter(requests)
        exhausted = False
        sched = self.scheduler
        target = self.config.max_num_seqs * LOOKAHEAD
        deadline = None
        while True:
            if deadline is None and should_stop is not None and should_stop():
                deadline = time.monotonic() + grace_s
                sched.admitting = False
                log.info("stop requested: draining %d running requests for up to %.0fs", len(sched.running), grace_s)
            if deadline is not None:
                if not sched.running or time.monotonic() >= deadline:
                    return
            else:
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
            results = self.step()
            if on_step is not None:
                on_step(self)
            yield from results

    def add_request(self, req: GenerationRequest) -> None:
        """Queue a request. With n > 1 its samples are sibling requests "<id>\\x00<i>" (seed + i
        when seeded): the first prefills the prompt, the others fork from it, sharing its KV. A
        constraint that does not compile makes it an error result."""
        sp = req.sampling
        now = time.perf_counter()
        samples = []
        for i in range(sp.n):
            child_sp = sp
            if sp.n > 1:
                child_sp = sp.model_copy(update={"n": 1, "seed": None if sp.seed is None else sp.seed + i})
            samples.append(Request(f"{req.request_id}\x00{i}", list(req.prompt_token_ids), child_sp,
                                   self.eos_token_ids, now))
        samples[0].forks = samples[1:]
        self.scheduler.add_request(samples[0])
        if sp.response_format is not None:
            error = self._constraint_error(sp.response_format)
            if error:
                self.scheduler.reject(samples[0], f"sampling.response_format: {error}")

    def _constraint_error(self, fmt) -> str | None:
        from .runner.guided import Constraints, GrammarBook

        if self.grammars is None:
            self.grammars = GrammarBook(self.tokenizer, self.model.shape.vocab_size, self.eos_token_ids)
        if self.runner.constraints is None:
            self.runner.constraints = Constraints(self.grammars)
        return self.grammars.error(fmt)

    def step(self) -> list[GenerationResult]:
        sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute(sched_out.seqs, sched_out.copy_to_cpu, sched_out.copy_to_device,
                                         sched_out.copy_within)
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

    def decode(self, token_ids: list[int]) -> str:
        """The text of generated tokens, without a character cut off mid-way (a byte-level token
        run that ends inside a multi-byte character decodes to U+FFFD; vLLM leaves it out too)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")

    def _check_stop_strings(self, req: Request) -> str | None:
        text = self.decode(req.output_token_ids)
        tail_from = max(0, len(text) - max(len(s) for s in req.sampling.stop) - 16)
        hits = [i for i in (text.find(s, tail_from) for s in req.sampling.stop) if i >= 0]
        if not hits:
            return None
        self.scheduler.finish_request(req.request_id, "stop")
        return text[: min(hits)]

    def _result(self, req: Request, text: str | None) -> GenerationResult:
        self.scheduler.release(req.request_id)
        if self.runner.constraints is not None:
            self.runner.constraints.forget(req.request_id)
        if text is None:
            text = self.decode(req.output_token_ids) if req.output_token_ids else ""
        times = req.token_times
        ttft = times[0] - req.arrival_time if times else None
        itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        rid, _, idx = req.request_id.rpartition("\x00")
        return GenerationResult(rid, int(idx), text, list(req.output_token_ids), req.finish_reason or "error",
                                req.error, req.num_prompt_tokens, req.num_cached_tokens, ttft, itl, req.logprobs,
                                req.num_preemptions, req.prompt_logprobs)

    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        t = self.kv_manager.tier
        cpu_used, cpu_blocks, _ = self.kv_manager.cpu_blocks()
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), kv_usage=self.kv_manager.usage(),
            prefix_hit_rate=self.kv_manager.prefix_hit_rate(), prefill_tokens=s.prefill_tokens,
            decode_tokens=s.decode_tokens, generated_tokens=s.generated_tokens, preemptions=s.num_preemptions, swap_preemptions=s.num_swap_preemptions,
            recompute_preemptions=s.num_recompute_preemptions, cpu_blocks_used=cpu_used,
            cpu_blocks=cpu_blocks, swapped_out_blocks=t.swapped_out_blocks,
            swapped_in_blocks=t.swapped_in_blocks, spilled_blocks=t.spilled_blocks, reloaded_blocks=t.reloaded_blocks)

    def counters(self) -> dict:
        """The engine's settings and counters for summary.json."""
        s = self.scheduler.stats
        st = self.stats()
        kv = self.kv_layout
        block_bytes = self.kv_cache.block_bytes
        return {
            "device": str(self.device), "dtype": build.dtype_name(self.dtype),
            "linear_path": self.backend.linear_path, "attention_backend": self.backend.attention,
            "fused_layer_ops": self.backend.layer_ops,
            "cuda_graph_replays": self.runner.graph_replays,
            "num_kv_blocks": kv.num_blocks, "block_size": self.config.block_size,
            "kv_cache_bytes": self.kv_cache.bytes, "kv_bytes_per_token": kv.bytes_per_token,
            "kv_cache_dtype": build.dtype_name(self.kv_dtype),
            "max_model_len": self.max_model_len, "sliding_window": self.window, "profile": self.config.profile,
            "kv_groups": [{"window": w, "layers": self.model.shape.group_layers(g), "blocks": n}
                          for g, ((n, _), w) in enumerate(zip(kv.group_blocks, self.model.shape.kv_groups))],
            "max_num_seqs": self.config.max_num_seqs, "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "steps": s.num_steps, "preemptions": st.preemptions,
            "prefill_tokens": st.prefill_tokens, "decode_tokens": st.decode_tokens, "peak_running": s.peak_running,
            "peak_kv_blocks": s.peak_kv_blocks, "prefix_hit_rate": round(st.prefix_hit_rate, 4),
            "prefix_cache_evictions": self.kv_manager.num_evictions,
            "preemptions_swap": st.swap_preemptions, "preemptions_recompute": st.recompute_preemptions,
            "cpu_kv_blocks": kv.num_cpu_blocks, "cpu_kv_bytes": self.kv_cache.cpu_bytes,
            "peak_cpu_kv_blocks": self.kv_manager.cpu_blocks()[2],
            "swapped_out_blocks": st.swapped_out_blocks, "swapped_in_blocks": st.swapped_in_blocks,
            "swapped_out_bytes": st.swapped_out_blocks * block_bytes,
            "swapped_in_bytes": st.swapped_in_blocks * block_bytes,
            "prefix_blocks_spilled": st.spilled_blocks, "prefix_blocks_reloaded": st.reloaded_blocks,
        }
