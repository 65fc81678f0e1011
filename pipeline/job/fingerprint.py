"""What decides a job's output. A resume under a different fingerprint would mix two jobs in one
output, so it is refused (the user may --restart)."""
from __future__ import annotations

import hashlib

from ..config import JobSpec
from ..io.rows import InputIndex, ids_digest

# Input settings that do not change any row's output.
_NOT_OUTPUT = ("path", "dataset", "window_rows")


def resolved_dtype(spec: JobSpec) -> str:
    """The dtype the run computes in (auto resolved for this machine's device)."""
    from ..runner.build import dtype_name, resolve_device, resolve_dtype

    return dtype_name(resolve_dtype(spec.model.dtype, resolve_device(spec.model.device)))


def fingerprint(spec: JobSpec, index: InputIndex, model_identity: str, context: int,
                shard: tuple[int, int] | None = None) -> dict:
    inputs = hashlib.sha256("\n".join(f"{s.name}:{s.num_rows}" for s in index.shards).encode())
    inputs.update(ids_digest(index.ids).encode())
    fp = {
        "model": model_identity,
        "dtype": resolved_dtype(spec),
        "kv_cache_dtype": spec.engine.kv_cache_dtype,
        "max_model_len": context,
        "sampling": spec.sampling.model_dump(mode="json"),
        "template": {k: v for k, v in spec.input.model_dump(mode="json").items() if k not in _NOT_OUTPUT},
        "on_too_long": spec.on_too_long,
        "inputs": inputs.hexdigest()[:32],
    }
    if shard is not None:
        fp["shard"] = f"{shard[0]}/{shard[1]}"
    return fp
