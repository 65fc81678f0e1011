"""Request state: what the scheduler knows about one sequence."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling options (vLLM's names)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 disables top-k.
    top_k: int = 0
    min_p: float = 0.0
    # A seed makes the sample depend only on (seed, position), never on the batch.
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    # Number of top log-probabilities to return per generated token (0: none).
    logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0

    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache (prompt and output alike).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache when the request was (last) admitted.
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    # Wall-clock times of each generated token, for TTFT and ITL.
    token_times: list[float] = field(default_factory=list)
    # Per generated token: (chosen logprob, {token: logprob} of the top-k), when asked for.
    logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
