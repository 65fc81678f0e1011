"""Request state: what the scheduler knows about one sequence."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# What each kind of constraint needs.
_FORMAT_FIELDS = {"json_schema": "schema", "regex": "pattern", "choice": "choices", "grammar": "ebnf", "json_object": None}


class ResponseFormat(BaseModel):
    """A constraint on the generated text: a JSON schema (inline, or a path to a .json file), any
    JSON object, a regular expression, one of a list of choices, or an EBNF grammar (xgrammar's
    dialect of GBNF)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    json_schema: dict | None = Field(None, alias="schema", description="JSON schema, or a path to a .json file")
    pattern: str | None = None
    choices: tuple[str, ...] | None = None
    ebnf: str | None = None

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_file(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                return json.loads(Path(v).read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot read the JSON schema file {v!r} ({e})") from None
        return v

    @model_validator(mode="after")
    def _needs_its_field(self) -> "ResponseFormat":
        need = _FORMAT_FIELDS[self.type]
        given = {f for f in ("schema", "pattern", "choices", "ebnf")
                 if getattr(self, "json_schema" if f == "schema" else f) is not None}
        if (need and need not in given) or given - {need}:
            raise ValueError(f"type {self.type} takes " + (f"`{need}`" if need else "no other field") +
                             f" (got: {', '.join(sorted(given)) or 'none'})")
        if self.type == "choice" and not self.choices:
            raise ValueError("type choice needs at least one choice")
        return self

    @property
    def key(self) -> str:
        """A stable digest of the constraint (the compile cache's key)."""
        data = json.dumps(self.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:24]


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
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description=(
        "Adds a prompt_logprobs column: per prompt token after the first, its logprob given the tokens before "
        "it and the top-K alternatives (the model's raw distribution). Such rows compute their whole prompt "
        "(no prefix-cache hit)"))
    response_format: ResponseFormat | None = Field(None, description=(
        "Constrain the text: {type: json_schema, schema: {...} or a file path}, {type: json_object}, "
        "{type: regex, pattern}, {type: choice, choices: [...]} or {type: grammar, ebnf}"))

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
    # With sampling.prompt_logprobs: per prompt token after the first, (logprob, top-k).
    prompt_logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
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
