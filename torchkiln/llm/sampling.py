"""Choosing the next token: transformers' logits processors, in its order, for the
arguments the fast path takes (repetition penalty, min_new_tokens, temperature, top-k,
top-p). Written here rather than calling transformers' processor objects because those
are built per generate() call from a GenerationConfig; these are a few tensor ops each,
and the same for every family. The semantics (including ties and the kept minimum of one
token in top-p) follow transformers so the fast path is a drop-in."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    eos: tuple = ()

    def __post_init__(self):
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r} must be > 0 when do_sample=True "
                             "(use do_sample=False for greedy)")
        # 0 keeps the top token and above 1 is off, as in transformers (it builds no top-p warper then)
        if self.top_p is not None and not self.top_p >= 0:
            raise ValueError(f"top_p={self.top_p!r} must be >= 0 (1 or more: off)")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be >= 0 (0 or None: off)")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be > 0 (1.0: off)")


def process(scores: torch.Tensor, seq: torch.Tensor, new: int, s: Sampling,
            stops: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' processors (penalty, min length) then, when sampling, its warpers. ``stops``:
    s.eos as a tensor on the scores' device, made once per generate (indexing with the Python
    list copies it to the device each token: on CUDA a synchronous copy, a sync per token)."""
    if s.repetition_penalty != 1.0:
        picked = scores.gather(1, seq)
        picked = torch.where(picked < 0, picked * s.repetition_penalty, picked / s.repetition_penalty)
        scores = scores.scatter(1, seq, picked)
    if new < s.min_new_tokens and s.eos:
        stops = stops if stops is not None else torch.tensor(s.eos, device=scores.device)
        # an eos id the head cannot produce (a config's eos past a small vocabulary) has no score to
        # mask; transformers' isin over the vocabulary skips it, index_fill raised IndexError
        scores = scores.masked_fill(torch.isin(torch.arange(scores.shape[-1], device=scores.device), stops),
                                    -float("inf"))
    if not s.do_sample:
        return scores
    if s.temperature != 1.0:
        scores = scores / s.temperature
    if s.top_k:
        k = min(s.top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if s.top_p is not None and s.top_p < 1.0:
        ordered, idx = torch.sort(scores, descending=False)
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - s.top_p)
        drop[..., -1:] = False
        scores = scores.masked_fill(drop.scatter(1, idx, drop), -float("inf"))
    return scores


def choose(scores: torch.Tensor, s: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    if s.do_sample:
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)
    if scores.is_cuda and scores.shape[-1] >= 16 * SPLIT:
        return argmax_split(scores)
    return scores.argmax(dim=-1)


# torch's argmax over one row of a large vocabulary is one reduction with little parallelism: 27.5 us
# per token over Llama-3's 128256 logits on the H200, 1.4% of an int4 decode step (the forty-third
# session's profile, benchmarks/RESULTS.md). In two passes (the max of each SPLIT-wide chunk, then the
# first best chunk) each pass spreads over the GPU.
SPLIT = 256


def argmax_split(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(dim=-1)`` for (B, V) scores, exactly, ties and NaN included: max(dim) gives the
    first index of each chunk's best (a NaN counts as the best, as in argmax), argmax the first chunk
    holding the overall best; padding with -inf at the end never wins a tie against a real score."""
    pad = -scores.shape[-1] % SPLIT
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=-float("inf"))
    best, at = scores.reshape(scores.shape[0], -1, SPLIT).max(dim=-1)
    chunk = best.argmax(dim=-1, keepdim=True)
    return (chunk * SPLIT + at.gather(-1, chunk)).squeeze(-1)
