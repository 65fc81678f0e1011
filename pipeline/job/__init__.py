"""Jobs: a spec in, durable resumable Parquet out.

prepare.py   spec -> id index, model, windows of tokenized requests (run, validate, plan, status, Ray)
run.py       run_job: the run loop (prepare, generate, commit, finish)
sink.py      finished rows -> buffered parts; the output schema
store        (batchgen.io.store) parts, ledger, lock
signals.py   StopFlag: SIGTERM/SIGINT/SIGUSR1, checked at safe points
progress.py  the bar / timed log lines
fingerprint.py  what a resume must match
finish.py    input-order compaction and OpenAI JSONL once complete
status.py    status from the ledgers
merge.py     every task's parts into merged/, by id
"""
from __future__ import annotations

from .merge import merge_job
from .prepare import prepare_job
from .run import run_job
from .status import job_status

__all__ = ["job_status", "merge_job", "prepare_job", "run_job"]
