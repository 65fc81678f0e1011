"""Several engines on one node: one process per device, each on a disjoint shard of the job,
under one progress display and one summary."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

from .config import JobSpec
from .errors import BatchgenError, Interrupted
from .io.store import atomic_write_json
from .metrics import latency_summary

log = logging.getLogger("batchgen")


def _worker(spec_data: dict, index: int, n: int, restart: bool, limit: int | None, device_count: int) -> None:
    # Before torch loads: each worker sees only its own GPU, or its share of the CPU cores.
    if device_count:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index % device_count)
    import torch

    if not device_count:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s batchgen[{index}] %(levelname)s %(message)s")
    from .job import run_job

    try:
        # A task may hold no rows (fewer rows than workers); the parent checked the input as a whole.
        run_job(JobSpec.model_validate(spec_data), restart=restart, limit=limit, shard=(index, n), progress=False,
                allow_empty=True)
    except BatchgenError as e:
        log.error("%s", e)
        raise SystemExit(e.exit_code)


def _cuda_device_count() -> int:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable CUDA means CPU workers
        return 0


def run_data_parallel(spec: JobSpec, n: int, restart: bool = False, limit: int | None = None,
                      poll_s: float = 2.0, allow_empty: bool = False) -> dict:
    from .errors import InputError
    from .io.sources import open_input
    from .job.progress import Progress
    from .job.signals import StopFlag
    from .job.status import count_done

    total = sum(s.num_rows for s in open_input(spec.input).shards)
    if total == 0 and not allow_empty:
        raise InputError("input: no rows to run; pass --allow-empty to accept an empty input")
    devices = _cuda_device_count() if spec.model.device != "cpu" else 0
    ctx = mp.get_context("spawn")
    data = spec.model_dump(mode="json")
    procs = [ctx.Process(target=_worker, args=(data, i, n, restart, limit, devices),
                         name=f"batchgen-{i}") for i in range(n)]
    start = time.monotonic()
    for p in procs:
        p.start()
    progress = Progress(total, interval_s=30.0)
    forwarded = False
    try:
        # A signal to this process alone (kill PID, not the process group) reaches the workers too,
        # as SIGTERM, so they drain and commit; Ctrl-C twice terminates them.
        with StopFlag() as stop:
            while any(p.is_alive() for p in procs):
                if stop.forced:
                    for p in procs:
                        p.terminate()
                    stop.check_forced()
                if stop and not forwarded:
                    forwarded = True
                    for p in procs:
                        if p.is_alive():
                            os.kill(p.pid, signal.SIGTERM)
                time.sleep(poll_s if not stop else min(poll_s, 0.2))
                progress.update(count_done(spec.output.path))
    finally:
        for p in procs:
            p.join()
        progress.close(count_done(spec.output.path))
    codes = [p.exitcode for p in procs]
    summary = combine_summaries(spec, n, time.monotonic() - start)
    summary["worker_exit_codes"] = codes
    atomic_write_json(Path(spec.output.path) / "summary.json", summary)
    if any(c == Interrupted.exit_code for c in codes):
        raise Interrupted("a worker was stopped by a signal after committing finished rows; rerun to resume")
    bad = [c for c in codes if c]
    if bad:
        raise BatchgenError(f"{len(bad)} of {n} workers failed (exit codes {codes}); rerun to resume the rest")
    return summary


def combine_summaries(spec: JobSpec, n: int, wall: float) -> dict:
    """Totals over the task summaries; latency percentiles recomputed from the output rows."""
    import json

    import pyarrow.parquet as pq

    from .io.store import OutputStore
    from .shard import task_root

    tasks = []
    for i in range(n):
        p = task_root(spec.output.path, (i, n)) / "summary.json"
        if p.exists():
            tasks.append(json.loads(p.read_text()))
    keys = ("rows_ok", "rows_error", "prompt_tokens", "completion_tokens", "rows_total", "rows_done")
    out = {k: sum(t.get(k) or 0 for t in tasks) for k in keys}
    ttft, itl = [], []
    for i in range(n):
        for f in OutputStore(task_root(spec.output.path, (i, n))).part_files():
            t = pq.read_table(f, columns=["ttft_s", "itl_s"])
            ttft += [x for x in t.column("ttft_s").to_pylist() if x is not None]
            itl += [x for x in t.column("itl_s").to_pylist() if x is not None]
    out.update(data_parallel=n, wall_s=round(wall, 3),
               output_tokens_per_s=round(out["completion_tokens"] / wall, 2) if wall > 0 else None,
               ttft_s=latency_summary(ttft), itl_s=latency_summary(itl), tasks=tasks,
               complete=out["rows_done"] == out["rows_total"] and len(tasks) == n)
    return out
