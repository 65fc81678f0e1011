"""Stop requests: SIGTERM, SIGINT and SIGUSR1 (Slurm's warning) ask the job to stop.

The handler only records the signal. The job looks at the flag at chosen points, so no signal
lands inside a commit, a tokenizer call or a build step, and no broad `except` can swallow it:
- before generation (between preparation steps and windows, after loading): stop at once with
  Interrupted (exit 75); nothing is lost, since nothing was generated;
- during generation: admission stops, running rows get engine.grace_s to finish, finished rows
  are committed, and the run exits 75;
- after the last row (flush, compaction, JSONL): the run finishes whole and exits 0.
A second SIGINT (Ctrl-C twice) sets `forced`: the next step or commit boundary stops the run
with Aborted (exit 130); rows committed so far are kept.
"""
from __future__ import annotations

import signal

from ..errors import Aborted, Interrupted

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopFlag:
    def __init__(self) -> None:
        self.signal: int | None = None
        self.forced = False
        self._old: dict = {}

    def __enter__(self) -> "StopFlag":
        for sig in SIGNALS:
            try:
                old = signal.getsignal(sig)
                if sig == signal.SIGINT and old == signal.SIG_IGN:
                    continue  # started with Ctrl-C ignored (nohup, a background job): keep it so
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                pass
        return self

    def _handle(self, signum, frame) -> None:
        # No logging or raising here: a handler that writes to stderr while the interrupted code
        # writes to it raises "reentrant call", and an exception can land anywhere.
        if signum == signal.SIGINT and self.signal is not None:
            self.forced = True
        if self.signal is None:
            self.signal = signum

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def __bool__(self) -> bool:
        return self.signal is not None

    def check_before_generation(self) -> None:
        """Nothing is generated yet: a pending signal stops the run here."""
        if self.signal is not None:
            raise Interrupted(f"stopped by signal {self.signal} before any row was generated; "
                              "rerun the same command to start")

    def check_forced(self) -> None:
        """Ctrl-C twice: stop at this safe point without draining."""
        if self.forced:
            raise Aborted("interrupted twice: stopped without draining; rows committed so far are kept, "
                          "rerun the same command to resume")
