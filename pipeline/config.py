"""The job spec: YAML validated by pydantic models that refuse unknown keys.

schemas/job.schema.json is generated from JobSpec (`batchgen schema`), and a test fails when
it is stale.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .engine.request import SamplingParams
from .errors import ConfigError

# Sampling fields an input column may override per row.
ROW_OVERRIDABLE = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "logprobs", "response_format")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(Strict):
    path: str = Field("default", description="'default' (bundled SmolLM2-135M-Instruct), a local HF folder, or a .gguf file")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights, activations and KV dtype. auto: float32 on CPU, bfloat16 on CUDA")
    device: Literal["auto", "cpu", "cuda"] = "auto"


class DatasetSpec(Strict):
    path: str = Field(description="A save_to_disk folder, local data files (parquet/json/csv), or a hub name in the local cache")
    split: str = "train"
    name: str | None = Field(None, description="Dataset configuration name, for hub datasets")


class InputSpec(Strict):
    format: Literal["parquet", "openai_batch"] = Field(
        "parquet", description="parquet, or openai_batch: OpenAI Batch API JSONL (custom_id, body.messages, "
                               "body.max_tokens, temperature, top_p, stop, seed)")
    path: str | list[str] | None = Field(None, description="Parquet (or JSONL) file, glob, directory, or a list of them")
    dataset: DatasetSpec | None = None
    prompt_column: str | None = Field(None, description="Column of prompt strings (default 'prompt' unless messages_column is set)")
    messages_column: str | None = Field(None, description="Column of chat messages: a list of {role, content}")
    id_column: str | None = Field(None, description="Unique row id column; else '<shard>:<row index>'")
    system_prompt: str | None = None
    chat_template: bool | None = Field(None, description="Apply the tokenizer's chat template (default: true when the model has one)")
    passthrough_columns: list[str] = Field(default_factory=list, description="Input columns copied to the output")
    window_rows: int = Field(100_000, ge=1, description=(
        "Rows read and tokenized at a time (in the background while the engine runs) and sorted by length "
        "within; memory follows it, not the input's size"))
    sampling_columns: dict[str, str] = Field(default_factory=dict, description=(
        "Per-row sampling overrides: {sampling field: column}, e.g. {max_tokens: max_tokens}. "
        f"Fields: {', '.join(ROW_OVERRIDABLE)}. A null cell keeps the job's value"))

    @model_validator(mode="after")
    def _one_source_one_prompt(self) -> "InputSpec":
        if (self.path is None) == (self.dataset is None):
            raise ValueError("give exactly one of input.path or input.dataset")
        if self.format == "openai_batch":
            if self.dataset is not None or self.prompt_column or self.id_column or self.passthrough_columns \
                    or self.sampling_columns:
                raise ValueError("input.format openai_batch reads custom_id and body.* itself: give only path "
                                 "(and optionally system_prompt, chat_template)")
            if self.messages_column != "body.messages":  # assignment re-runs this validator
                self.messages_column = "body.messages"
            return self
        if self.prompt_column and self.messages_column:
            raise ValueError("give input.prompt_column or input.messages_column, not both")
        if not self.prompt_column and not self.messages_column:
            self.prompt_column = "prompt"
        bad = sorted(set(self.sampling_columns) - set(ROW_OVERRIDABLE))
        if bad:
            raise ValueError(f"sampling_columns: {bad} cannot be set per row; allowed: {', '.join(ROW_OVERRIDABLE)}")
        return self

    @property
    def per_row_n(self) -> bool:
        """Whether a row may ask for its own number of samples."""
        return self.format == "openai_batch" or "n" in self.sampling_columns

    @property
    def per_row_response_format(self) -> bool:
        """Whether a row may carry a constraint of its own."""
        return self.format == "openai_batch" or "response_format" in self.sampling_columns

    @property
    def per_row_logprobs(self) -> bool:
        """Whether a row may ask for logprobs of its own."""
        return self.format == "openai_batch" or "logprobs" in self.sampling_columns

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path or [])


class OutputSpec(Strict):
    path: str = Field(description="Output folder: part files, ledger and summary.json")
    openai_jsonl: bool | None = Field(None, description="Also write OpenAI-style results.jsonl and errors.jsonl when "
                                                       "the job completes (default: true for openai_batch input)")
    rows_per_part: int = Field(1000, ge=1, description="Rows per Parquet part file")
    flush_interval_s: float = Field(60.0, gt=0, description="Write a part at least this often, even if not full")
    order: Literal["completion", "input"] = Field(
        "completion", description="completion: parts in finishing order; input: compacted into input order at the end")


class SamplingSpec(SamplingParams):
    """The job's `sampling:` section: the engine's SamplingParams with the job's defaults."""

    max_tokens: int = Field(256, ge=1)


class EngineSpec(Strict):
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block")
    max_num_seqs: int = Field(256, ge=1, description="Most sequences in one batch")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget of one step (prefill chunks + decodes)")
    kv_cache_gib: float | None = Field(None, gt=0, description="KV budget in GiB; default: kv_cache_fraction of free memory")
    kv_cache_fraction: float = Field(0.25, gt=0, le=0.95)
    max_model_len: int | None = Field(None, ge=1, description="Cap on prompt + output tokens (default: the model's)")
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = Field(
        "auto", description="KV storage: auto (the model dtype); int8 with per-token-head scales (~3.7x more "
                            "tokens than fp32, CPU paths); fp8 e4m3 with per-token-head scales (the Triton kernels "
                            "on CUDA; on a CPU the torch path)")
    prefix_caching: bool = Field(True, description="Reuse KV of shared prompt prefixes (full blocks)")
    cpu_offload_gib: float = Field(0.0, ge=0, description="Host-memory KV tier for swapped-out requests and spilled "
                                                        "prefix blocks; 0 turns it off")
    preemption: Literal["auto", "swap", "recompute"] = Field(
        "auto", description="A preempted request's KV: swap to the CPU tier, recompute later, or auto (by estimated cost)")
    linear_path: Literal["auto", "plain", "onednn", "dpbf16", "amx", "fma"] = Field(
        "auto", description="CPU GEMM path; plain is F.linear, onednn oneDNN on packed weights, dpbf16 our "
                            "AVX512-BF16 GEMM for bf16 weights, amx our AMX-tile GEMM for bf16 weights (auto on "
                            "AMX CPUs), fma our AVX2 GEMMs for fp32 and bf16 weights (fp32 on "
                            "our AVX-512 GEMM where the CPU has AVX-512; auto takes fma on AVX2 CPUs without "
                            "AVX-512, and for fp32 on AMD Zen 4)")
    decode_attention: Literal["batched", "exact"] = "batched"
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        "auto", description="auto: Triton kernels on CUDA; on a CPU the C++ decode op (cpu), built on first use, or "
                            "torch where no compiler is at hand. torch forces the plain torch path")
    cuda_graphs: bool = Field(True, description="On CUDA with the Triton kernels, replay decode-only steps from CUDA "
                                                "graphs captured per batch-size bucket")
    seed: int = Field(0, description="Seed of the shared stream used by unseeded rows")
    grace_s: float = Field(60.0, ge=0, description="After SIGTERM/SIGUSR1: seconds in-flight requests may finish "
                                                   "before the run flushes and exits 75")
    data_parallel: int = Field(1, ge=1, description="Engine processes on this node, one per device, disjoint shards")
    profile: Literal["throughput", "latency"] = Field(
        "throughput", description="throughput: as configured; latency: caps the batch at 16 sequences and 512 "
                                  "tokens a step to keep inter-token latency low")


class JobSpec(Strict):
    model: ModelSpec = Field(default_factory=ModelSpec)
    input: InputSpec
    output: OutputSpec
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    on_too_long: Literal["error", "truncate_left", "fail"] = Field(
        "error", description="A prompt over the context: error row, keep its last tokens, or fail the job")

    @field_validator("model", mode="before")
    @classmethod
    def _model_string(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, str) else v


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid job spec"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see schemas/job.schema.json)"
        elif "input" in e and not isinstance(e["input"], (dict, list)):
            msg += f" (got {e['input']!r})"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def _set_dotted(data: dict, dotted: str) -> None:
    key, sep, raw = dotted.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {dotted!r}: expected dotted.key=value")
    value = yaml.safe_load(raw) if raw else ""
    node = data
    parts = key.split(".")
    for p in parts[:-1]:
        if p == "model" and isinstance(node.get(p), str):
            node[p] = {"path": node[p]}  # `model: X` is short for `model: {path: X}`
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted!r}: {p} is not a section")
    node[parts[-1]] = value


def load_job(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: job file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the job must be a YAML mapping (model, input, output, ...)")
    for o in overrides or []:
        _set_dotted(data, o)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(path))) from None


def job_json_schema() -> dict:
    schema = JobSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "batchgen job"
    return schema
