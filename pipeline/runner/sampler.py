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

    def __call__(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> list[SampledToken]:
        """logits [num_seqs, vocab] (fp32, or bf16 on the fused path), one row per seq -> one
        token per seq; everything works in fp32 (bf16 -> fp32 is exact and keeps the order, and
        torch's argmax over bf16 is slower than converting first)."""
        params = [s.sampling for s in seqs]
        want_logprobs = any(p.logprobs for p in params)
        if self.fused_argmax and not want_logprobs and all(p.greedy for p in params):
            from batchgen.kernels.cpu_attention import argmax_rows

            return [SampledToken(t) for t in argmax_rows(logits).tolist()]
        logits = logits.float()
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            # Seeded rows draw from CPU generators, so their samples are the same on any device.
            logits = logits.cpu()
            tokens = self._sample(logits, seqs)
        token_list = tokens.tolist()
        if not want_logprobs:
            return [SampledToken(t) for t in token_list]
        logp = torch.log_softmax(logits.float().cpu(), dim=-1)
        out = []
        for i, (t, p) in enumerate(zip(token_list, params)):
            top = None
            if p.logprobs:
                vals, idx = logp[i].topk(p.logprobs)
                top = dict(zip(idx.tolist(), vals.tolist()))
            out.append(SampledToken(t, float(logp[i, t]), top))
        return out

    def _sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        params = [s.sampling for s in seqs]
        n, vocab = logits.shape
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=torch.float32)
        scaled = logits / temps[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            scaled = _filter(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        for i, (seq, p) in enumerate(zip(seqs, params)):
            gen = _row_generator(p.seed, seq.output_index) if p.seed is not None else self.generator
            noise[i].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        greedy = torch.tensor([p.greedy for p in params])
        return torch.where(greedy, logits.argmax(dim=-1), sampled)


def _filter(logits: torch.Tensor, params) -> torch.Tensor:
    """Mask tokens outside each row's top-k / top-p / min-p set with -inf."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])[:, None]
    mask = ranks >= top_k
    probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)[:, None]
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mask |= (probs.cumsum(dim=-1) - probs) > top_p
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)[:, None]
    mask |= probs < min_p * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
