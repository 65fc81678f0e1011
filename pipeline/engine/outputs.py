"""Plain dataclasses passed between the scheduler and the model runner."""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import SamplingParams


@dataclass
class ScheduledSeq:
    request_id: str
    # Token ids to run this step: [start_pos, start_pos + len(token_ids)).
    token_ids: list[int]
    # Position of token_ids[0]; equals the request's num_computed_tokens before the step.
    start_pos: int
    # Physical block ids holding positions [0, start_pos + len(token_ids)).
    block_table: list[int]
    # True when this chunk reaches the end of the known tokens, so the next token is sampled.
    sample: bool
    sampling: SamplingParams
    # Index of the token about to be sampled among the outputs; with the seed it fixes the draw.
    output_index: int
    # Sibling samples (n > 1) that fork from this sequence once its prompt is in: each draws its
    # own first token from this sequence's last logits. (request id, sampling) per sibling.
    forks: list[tuple[str, SamplingParams]] = field(default_factory=list)
    # Prompt logprobs: the prompt tokens at positions start_pos + 1, start_pos + 2, ... that this
    # chunk's rows predict (each row's next prompt token), scored under the raw distribution.
    score_targets: list[int] = field(default_factory=list)
    # Hybrid KV (layers of several attention kinds): the block tables of the KV groups after the
    # first (block_table is group 0's, the full-attention layers'); empty with one group.
    group_tables: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    # Requests run this step, decodes first, then prefill chunks.
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # Requests preempted (freed for recompute) while making room this step.
    preempted: list[str] = field(default_factory=list)
    # Requests that ended without running (they can never fit); their results are final.
    rejected: list[str] = field(default_factory=list)
    # Block copies the runner makes before the forward pass, in this order:
    # (device block, CPU block) pairs (swap-outs and prefix spills), then
    # (CPU block, device block) pairs (swap-ins and prefix reloads). With hybrid KV each copy is
    # a (group, source, destination) triple.
    copy_to_cpu: list[tuple[int, int]] = field(default_factory=list)
    copy_to_device: list[tuple[int, int]] = field(default_factory=list)
    # (device block, device block) pairs: a forked sample's copy of its parent's partial block,
    # made after the tier copies and before the forward pass.
    copy_within: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class SampledToken:
    token_id: int
    # log-probability of token_id, and the top-k {token: logprob}, when asked for.
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    # The request's constraint is complete with this token (it stops with "stop"), or refused it.
    terminated: bool = False
    rejected: bool = False


@dataclass
class RunnerOutput:
    # request_id -> the token sampled at its last scheduled position (sampled seqs only).
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    # request_id -> prompt logprobs computed this step, in prompt order: (token logprob, top-k).
    prompt_logprobs: dict[str, list[tuple[float, dict[int, float]]]] = field(default_factory=dict)
