"""Token sampling: greedy, temperature, top-k, top-p, min-p, with batch-independent seeds.

A seeded row draws its noise from a generator seeded by (seed, output index), so its text is
the same whatever batch it lands in and however often it is preempted and recomputed.
Sampling uses the exponential race (argmax of p / E, E ~ Exp(1)), which is exact.
"""
from __future__ import annotations

import torch

from ..engine.outputs import SampledToken, ScheduledSeq

_MASK64 = (1 << 63) - 1


def _row_generator(seed: int, output_index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + output_index * 7_919 + 0x9E3779B9) & _MASK64)


class Sampler:
    def __init__(self, seed: int = 0, fused_argmax: bool = False) -> None:
        # For rows without a seed: one stream for the whole run.
        self.generator = torch.Generator().manual_seed(seed)
        # Greedy rows through the C++ argmax (with the CPU ops loaded).
        self.fused_argmax = fused_argmax

    def __call__(self, logits: torch.Tensor, seqs: list[ScheduledSeq], mask=None) -> list[SampledToken]:
        """logits [num_seqs, vocab] (fp32, or bf16 on the fused path), one row per seq -> one
        token per seq; everything works in fp32 (bf16 -> fp32 is exact and keeps the order, and
        torch's argmax over bf16 is slower than converting first).

        Logprobs (rows with sampling.logprobs set) are those of the distribution the token was
        drawn from: the logits divided by the temperature, with tokens outside top-k / top-p /
        min-p at -inf; for greedy rows, the logits as they are. mask(logits) applies the rows'
        constraints (disallowed tokens at -inf) to fp32 logits in place, before all that."""
        params = [s.sampling for s in seqs]
        want_logprobs = any(p.logprobs is not None for p in params)
        greedy = all(p.greedy for p in params)
        if mask is not None:
            logits = logits.cpu()
            mask(logits)  # in the logits' own dtype: -inf survives the conversion below
        if self.fused_argmax and not want_logprobs and greedy:
            from batchgen.kernels.cpu_attention import argmax_rows

            return [SampledToken(t) for t in argmax_rows(logits).tolist()]
        logits = logits.float()
        if greedy and not want_logprobs:
            return [SampledToken(t) for t in logits.argmax(dim=-1).tolist()]
        # Seeded rows draw from CPU generators, so their samples are the same on any device.
        logits = self.processed(logits.cpu(), params)
        tokens = self._draw(logits, seqs).tolist()
        if not want_logprobs:
            return [SampledToken(t) for t in tokens]
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        logp = torch.log_softmax(logits[rows], dim=-1)
        out = [SampledToken(t) for t in tokens]
        for k, i in enumerate(rows):
            t, top_k = tokens[i], params[i].logprobs
            top = None
            if top_k:
                vals, idx = logp[k].topk(top_k)
                top = dict(zip(idx.tolist(), vals.tolist()))
            out[i] = SampledToken(t, float(logp[k, t]), top)
        return out

    @staticmethod
    def processed(logits: torch.Tensor, params) -> torch.Tensor:
        """The logits each row samples from: divided by its temperature (greedy rows as they
        are), then top-k / top-p / min-p filtered to -inf."""
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=torch.float32)
        scaled = logits / temps[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params if not p.greedy):
            scaled = _filter(scaled, params)
        return scaled

    def _draw(self, scaled: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """The exponential race over each row's softmax (argmax for greedy rows)."""
        params = [s.sampling for s in seqs]
        greedy = torch.tensor([p.greedy for p in params])
        if bool(greedy.all()):
            return scaled.argmax(dim=-1)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        for i, (seq, p) in enumerate(zip(seqs, params)):
            if p.greedy:
                noise[i] = 1.0
                continue
            gen = _row_generator(p.seed, seq.output_index) if p.seed is not None else self.generator
            noise[i].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, scaled.argmax(dim=-1), sampled)


def _filter(logits: torch.Tensor, params) -> torch.Tensor:
    """Mask tokens outside each row's top-k / top-p / min-p set with -inf."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 and not p.greedy else vocab for p in params])[:, None]
    mask = ranks >= top_k
    probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
    top_p = torch.tensor([p.top_p if not p.greedy else 1.0 for p in params], dtype=torch.float32)[:, None]
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mask |= (probs.cumsum(dim=-1) - probs) > top_p
    min_p = torch.tensor([p.min_p if not p.greedy else 0.0 for p in params], dtype=torch.float32)[:, None]
    mask |= probs < min_p * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
