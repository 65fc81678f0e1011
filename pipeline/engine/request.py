"""Request state: what the scheduler knows about one sequence."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """Per-request sampling options (vLLM's names), validated once where they are made: the
    job spec's `sampling:` section is this model (with the job's defaults), and per-row
    overrides go through `with_overrides`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, description="Per-row seeds derive from it and the row id: same text in any batch")
    stop: tuple[str, ...] = Field((), description="Stop strings (not included in the text)")
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = Field(1, ge=1, description="Samples per row; each sample is its own output row with sample_index")
    logprobs: int | None = Field(None, ge=0, le=20, description=(
        "Adds a logprobs column: per generated token its logprob and the top-K alternatives (0: the token's own "
        "only). Of the distribution sampled from: after temperature, top-k/top-p/min-p and any constraint"))

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def with_overrides(self, changes: dict) -> "SamplingParams":
        """A copy with user-given changes, validated by the same rules (ValidationError)."""
        return type(self).model_validate({**self.__dict__, **changes})


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
    # Sibling samples (n > 1) not started yet: they fork from this request once its prompt is
    # computed, sharing its prompt's KV blocks instead of prefilling the prompt again.
    forks: list["Request"] = field(default_factory=list)

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
