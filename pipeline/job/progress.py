"""Progress of a run: a tqdm bar on a TTY; plain log lines on a timer otherwise (cron, Slurm).

Both are fed every engine step, so tokens/s and KV use move while rows are still running, and
lines come every interval whatever finishes."""
from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("batchgen")

# Seconds between bar refreshes on a TTY.
_BAR_REFRESH_S = 0.5


class Progress:
    def __init__(self, total: int, interval_s: float = 30.0, enabled: bool = True, stream=None) -> None:
        self.total = total
        self.enabled = enabled
        stream = stream or sys.stderr
        self.tty = enabled and stream.isatty()
        self.interval = interval_s
        self.start = self.last = self.last_bar = time.monotonic()
        self._last_counts = (0, 0)
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="row", dynamic_ncols=True, file=stream)

    def eta(self, done: int, now: float) -> float | None:
        """Seconds left, once enough rows are done for the rate to mean something."""
        if done < max(1, self.total // 100) or done >= self.total:
            return None
        return (now - self.start) / done * (self.total - done)

    def update(self, done: int, stats=None, force: bool = False) -> None:
        """done: rows committed or finished; stats: the engine's EngineStats (or None)."""
        if not self.enabled:
            return
        now = time.monotonic()
        elapsed = max(now - self.start, 1e-9)
        tokens = stats.generated_tokens if stats is not None else 0
        if self.bar is not None:
            if force or now - self.last_bar >= _BAR_REFRESH_S:
                self.last_bar = now
                self.bar.n = done
                post = f"{tokens / elapsed:.0f} tok/s"
                if stats is not None:
                    post += f" kv {stats.kv_usage:.0%} running {stats.running}"
                self.bar.set_postfix_str(post, refresh=False)
                self.bar.refresh()
            return
        if not force and now - self.last < self.interval:
            return
        eta = self.eta(done, now)
        line = f"progress: {done}/{self.total} rows, {tokens / elapsed:.1f} output tok/s"
        if eta is not None:
            line += f", ETA {eta:.0f}s"
        if stats is not None:
            dt = max(now - self.last, 1e-9)
            pre = (stats.prefill_tokens - self._last_counts[0]) / dt
            dec = (stats.decode_tokens - self._last_counts[1]) / dt
            self._last_counts = (stats.prefill_tokens, stats.decode_tokens)
            line += (f", running {stats.running}, waiting {stats.waiting}, kv {stats.kv_usage:.0%}, "
                     f"prefix hits {stats.prefix_hit_rate:.0%}, prefill {pre:.0f} tok/s, decode {dec:.0f} tok/s, "
                     f"preemptions {stats.preemptions} (swap {stats.swap_preemptions}, "
                     f"recompute {stats.recompute_preemptions})")
            if stats.cpu_blocks:
                line += (f", cpu tier {stats.cpu_blocks_used}/{stats.cpu_blocks} blocks, swapped out/in "
                         f"{stats.swapped_out_blocks}/{stats.swapped_in_blocks} blocks, spilled/reloaded "
                         f"{stats.spilled_blocks}/{stats.reloaded_blocks}")
        log.info("%s", line)
        self.last = now

    def close(self, done: int, stats=None) -> None:
        self.update(done, stats, force=True)
        if self.bar is not None:
            self.bar.close()
