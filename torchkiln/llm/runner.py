"""The decode engine behind a fast generate(): the FastDecoder, its cache, and the compiled steps.

Prefill runs the decoder eagerly: its length changes with every prompt, it runs once per
generate, and at batch 1 its cost is the same weight read as one decode step. The decode
step (batch B, one token) is compiled once per (batch, cache length) with static shapes;
on CUDA with CUDA graphs (mode="reduce-overhead"), because at batch 1 the step is a few
hundred small kernels whose launch cost, not the weight read, is what an eager step pays.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from .._log import warn_once
from ..modelutil import first_line, is_oom
from .model import FastDecoder, fresh

log = logging.getLogger(__name__)
CACHE_ROUND = 256  # cache lengths grow in multiples of this: each new length compiles once
# Compile options for the decode step, per compile (never the global inductor config).
# "triton.cudagraphs" is what mode="reduce-overhead" sets; coordinate-descent tuning tunes the
# batch-1 GEMV/reduction kernels' launch configs (gpt-fast sets it globally).
CUDA_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}


class Runner:
    def __init__(self, decoder: FastDecoder, device: torch.device, compile: bool, cudagraphs: bool,
                 max_seq_len: int | None, report):
        self.decoder, self.device = decoder, device
        self.compile, self.cudagraphs = compile, cudagraphs
        self.max_seq_len, self.report = max_seq_len, report
        self._steps: dict = {}  # (kind, width, batch, cache length) -> the step that runs it
        self.options = dict(CUDA_OPTIONS) if cudagraphs else {}

    def reserve(self, batch: int, need: int) -> None:
        """A cache for ``batch`` rows and ``need`` positions: a clear error past max_seq_len (or the
        model's own limit), else reuse, else (re)allocate rounded up."""
        spec = self.decoder.spec
        limit = self.max_seq_len or spec.max_positions
        if need > limit:
            what = f"max_seq_len={self.max_seq_len}" if self.max_seq_len else \
                f"the model's max_position_embeddings={spec.max_positions}"
            raise ValueError(f"prompt plus max_new_tokens is {need} tokens, more than {what}; "
                             "shorten the prompt or max_new_tokens" +
                             (", or pass a larger max_seq_len= to tk.llm.optimize" if self.max_seq_len else ""))
        if spec.sliding_window is not None and need > spec.sliding_window:
            raise ValueError(f"{need} tokens exceed the model's sliding_window={spec.sliding_window}; the fast "
                             "path keeps a full cache. Use fewer tokens or the model's own generate")
        d = self.decoder
        if d.batch == batch and d.seq >= need:
            return
        seq = self.max_seq_len or min(limit, -(-need // CACHE_ROUND) * CACHE_ROUND)
        d.setup_cache(batch, seq)
        self.report.cache = {"batch": batch, "seq": seq}

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        d = self.decoder
        d.key_ok.fill_(True)
        d.key_ok[:, :ids.shape[1]] = mask.bool()
        return d(ids, torch.arange(ids.shape[1], device=self.device), positions)

    @torch.no_grad()
    def decode(self, token: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self._call("decode", token, slot, pos)

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits at every position of ``tokens`` (1, K+1): the last chosen token and K
        speculated ones, written at slots slot..slot+K. A fixed K keeps one compiled shape."""
        offsets = torch.arange(tokens.shape[1], device=self.device)
        return self._call("verify", tokens, slot + offsets, pos + offsets)

    def _call(self, kind: str, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The step for ``kind`` at this input width and cache shape, compiled on first use. A
        compile failure steps down to eager for good: never fail where the eager step works."""
        key = (kind, tokens.shape[1], self.decoder.batch, self.decoder.seq)
        step = self._steps.get(key)
        if step is not None:
            return step(tokens, slots, positions)
        step = self._build(every=kind == "verify")
        t0 = time.perf_counter()
        try:
            out = step(tokens, slots, positions)
        except Exception as e:  # noqa: BLE001
            if not self.compile or is_oom(e):
                raise
            self.compile = self.cudagraphs = False
            self.report.fallbacks.append(f"compiled {kind} step -> eager: {first_line(e)}")
            warn_once("llm-compile", f"torchkiln.llm: the compiled {kind} step failed ({first_line(e)}); "
                      "decoding eagerly")
            step = self._build(every=kind == "verify")
            out = step(tokens, slots, positions)
        else:
            if self.compile:
                self.report.compile_s.append(round(time.perf_counter() - t0, 2))
        self._steps[key] = step
        return out

    def _build(self, every: bool = False):
        decoder = self.decoder
        if not self.compile:
            return functools.partial(decoder, every=True) if every else decoder
        # A code object of its own per compiled step: dynamo caches compiled code per code object,
        # and every FastDecoder shares forward's, so the 5th model of a process (or a model's 9th
        # batch/cache shape) reached the recompile limit (8) and decoded eagerly from then on.
        step = fresh(lambda tokens, slots, positions: decoder(tokens, slots, positions, every=every))
        return torch.compile(step, options=self.options or None, fullgraph=True, dynamic=False)
