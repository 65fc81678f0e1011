"""Continuous batching: every step spends a token budget on running decodes first, then on
prefill chunks, admitting waiting requests while blocks and seats last. When blocks run out,
the newest running request is preempted and later recomputed."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .kv_manager import HybridKVManager, KVCacheManager
from .outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from .request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    # "recompute", "swap" (to the CPU tier when it has room), or "auto": swap when moving the
    # blocks out and back is estimated cheaper than recomputing their tokens.
    preemption: str = "auto"
    # For "auto": estimated seconds to recompute one token, and to move one block out and in.
    recompute_s_per_token: float = 1e-3
    swap_s_per_block: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.preemption not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption must be auto, swap or recompute, got {self.preemption!r}")


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    # Tokens sampled (generated) so far, every request and sample together.
    generated_tokens: int = 0
    peak_running: int = 0
    peak_kv_blocks: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager | HybridKVManager,
                 clock=time.perf_counter) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._rejected: list[Request] = []
        # False while draining (a stop signal): running requests finish, nobody new starts.
        self.admitting = True

    # -- admission -------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a request; its forks (sibling samples) are known here and start from it later."""
        for r in [req] + req.forks:
            if r.request_id in self.requests:
                raise ValueError(f"duplicate request id {r.request_id!r}")
            self.requests[r.request_id] = r
        reason = self._never_fits(req)
        if reason:
            self.reject(req, reason)
            return
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def reject(self, req: Request, reason: str) -> None:
        """End a request just added (and its forks) as an error, reported at the next step."""
        for r in [req] + req.forks:
            if r.request_id in self.requests and not r.is_finished:
                if r in self.waiting:
                    self.waiting.remove(r)
                self._finish(r, "error", error=reason)
                self._rejected.append(r)
        req.forks = []

    def _never_fits(self, req: Request) -> str | None:
        if req.num_prompt_tokens == 0:
            return "empty prompt"
        total = req.num_prompt_tokens + req.sampling.max_tokens
        if total > self.config.max_model_len:
            return (f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.sampling.max_tokens}) "
                    f"exceeds the model's max length {self.config.max_model_len}")
        short = self.kv.shortfall(total, self.config.max_num_batched_tokens)
        if short:
            return (f"needs {short[0]} KV blocks for {total} tokens but the cache holds only "
                    f"{short[1]}; raise engine.kv_cache_gib or lower max_tokens")
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._rejected)

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(rejected=[r.request_id for r in self._rejected])
        self._rejected.clear()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        # Oldest first: decodes of earlier admissions go ahead of the newest prefill chunks, and a
        # victim preempted from the tail of `running` has never been scheduled in this step.
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._make_room(req, n, out):
                continue
            scheduled.append((req, n))
            self.kv.cache_blocks(req, req.num_computed_tokens + n)
            budget -= n
        if not out.preempted and self.admitting:
            budget = self._admit(budget, scheduled)
        out.seqs = [self._scheduled_seq(req, n) for req, n in scheduled]
        out.copy_to_cpu, out.copy_to_device, out.copy_within = self.kv.take_transfers()
        self._account(out)
        return out

    def _make_room(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Allocate n slots for a running request, preempting the newest requests as needed.
        False when req itself had to be preempted."""
        while self.kv.allocate_slots(req, n) is None:
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _admit(self, budget: int, scheduled: list[tuple[Request, int]]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self.kv.is_swapped(req):
                # Its KV comes back from the CPU tier: nothing to recompute.
                hit, num_cached = None, req.num_computed_tokens
            elif req.sampling.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens - 1:
                hit, num_cached = None, 0  # every prompt position is scored: nothing may come from the cache
            else:
                hit, num_cached = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_cached, budget)
            if self.kv.allocate_slots(req, n, hit) is None:
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            if hit is not None:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            # Published now, not after the step: a later admission of this step whose prompt
            # starts the same way takes these blocks instead of computing them again.
            self.kv.cache_blocks(req, num_cached + n)
            budget -= n
        return budget

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        if self._should_swap(req):
            self.kv.swap_out(req)
            self.stats.num_swap_preemptions += 1
        else:
            self.kv.free(req)
            req.num_computed_tokens = 0
            self.stats.num_recompute_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def _should_swap(self, req: Request) -> bool:
        cfg = self.config
        if cfg.preemption == "recompute" or not self.kv.can_swap_out(req):
            return False
        if cfg.preemption == "swap":
            return True
        blocks = self.kv.blocks_needed(req.num_computed_tokens)
        return blocks * cfg.swap_s_per_block < req.num_computed_tokens * cfg.recompute_s_per_token

    def _scheduled_seq(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        sample = start + n == req.num_tokens
        targets = []
        if req.sampling.prompt_logprobs is not None:
            end = min(start + n, req.num_prompt_tokens - 1)
            targets = req.prompt_token_ids[start + 1 : end + 1]
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.token_ids_slice(start, start + n),
            start_pos=start,
            block_table=self.kv.block_ids(req.request_id),
            group_tables=self.kv.group_block_ids(req.request_id),
            sample=sample,
            sampling=req.sampling,
            output_index=req.num_output_tokens,
            forks=[(f.request_id, f.sampling) for f in req.forks] if sample and req.num_output_tokens == 0 else [],
            score_targets=list(targets),
        )

    def _account(self, out: SchedulerOutput) -> None:
        s = self.stats
        s.num_steps += 1
        for seq in out.seqs:
            if len(seq.token_ids) == 1 and seq.start_pos >= self.requests[seq.request_id].num_prompt_tokens:
                s.decode_tokens += 1
            else:
                s.prefill_tokens += len(seq.token_ids)
        s.peak_running = max(s.peak_running, len(self.running))
        s.peak_kv_blocks = max(s.peak_kv_blocks, self.kv.num_used_blocks)

    # -- results ---------------------------------------------------------------------------

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply a step's results. Returns the requests that got a new token (finished ones
        included); finished requests have left the running set and freed their blocks."""
        now = self.clock()
        self.kv.end_step()
        touched: list[Request] = []
        for seq in sched.seqs:
            req = self.requests[seq.request_id]
            req.num_computed_tokens += len(seq.token_ids)
            self.kv.free_out_of_window(req)
            for i, v in enumerate(result.prompt_logprobs.get(seq.request_id, ())):
                if seq.start_pos + i == len(req.prompt_logprobs):  # a recompute scores again; keep the first
                    req.prompt_logprobs.append(v)
            tok = result.sampled.get(seq.request_id)
            if tok is None:
                continue
            if seq.forks:
                touched += self._start_forks(req, result, now)
            self._append_token(req, tok, now)
            touched.append(req)
        for req_id in sched.rejected:
            touched.append(self.requests[req_id])
        return touched

    def _append_token(self, req: Request, tok, now: float) -> None:
        req.output_token_ids.append(tok.token_id)
        req.token_times.append(now)
        self.stats.generated_tokens += 1
        if tok.logprob is not None:
            req.logprobs.append((tok.logprob, tok.top_logprobs or {}))
        if tok.rejected:
            self._finish(req, "error", error=f"the response_format constraint refused token {tok.token_id}")
            return
        reason = "stop" if tok.terminated else self._stop_reason(req, tok.token_id)
        if reason:
            self._finish(req, reason)

    def _start_forks(self, parent: Request, result: RunnerOutput, now: float) -> list[Request]:
        """parent's prompt is in: each sibling takes its KV (shared blocks) and the first token the
        runner drew for it from parent's logits, and joins the running batch. A sibling that finds
        no seat or block waits instead, to be admitted as a request of its own (a prefix hit)."""
        started = []
        for child in parent.forks:
            tok = result.sampled.get(child.request_id)
            if tok is None or len(self.running) >= self.config.max_num_seqs or not self.kv.fork(parent, child):
                child.status = RequestStatus.WAITING
                self.waiting.appendleft(child)
                continue
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_prompt_tokens
            child.prompt_logprobs = list(parent.prompt_logprobs)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            self._append_token(child, tok, now)
            started.append(child)
        parent.forks = []
        return started

    def _stop_reason(self, req: Request, token_id: int) -> str | None:
        sp = req.sampling
        if not sp.ignore_eos and token_id in req.eos_token_ids:
            return "stop"
        if token_id in sp.stop_token_ids:
            return "stop"
        if req.num_output_tokens >= sp.max_tokens:
            return "length"
        return None

    def finish_request(self, request_id: str, reason: str, error: str | None = None) -> None:
        """End a request from outside (a stop string matched, or the caller aborts it)."""
        req = self.requests[request_id]
        if not req.is_finished:
            self._finish(req, reason, error)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.forget(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error

    def release(self, request_id: str) -> Request:
        """Forget a finished request once its result has been handed out."""
        return self.requests.pop(request_id)
