"""The decode engine behind a fast generate(): the FastDecoder, its cache, and the compiled steps.

Prefill runs the decoder uncompiled: its length changes with every prompt and it runs once per
generate. On CUDA a short prompt's prefill is replayed from a CUDA graph captured per padded
width (no compile, a capture costs about two eager calls): eagerly it is ~700 small launches
whose host cost, not the weight read, set its time. The decode
step (batch B, one token) is compiled once per (batch, cache length) with static shapes;
on CUDA with CUDA graphs (mode="reduce-overhead"), because at batch 1 the step is a few
hundred small kernels whose launch cost, not the weight read, is what an eager step pays.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import NamedTuple

import torch

from .._log import quiet_deprecations, warn_once
from ..captured import captured
from ..modelutil import first_line, is_oom
from .generate import Fallback
from .model import FastDecoder, fresh

log = logging.getLogger(__name__)
CACHE_ROUND = 256  # cache lengths grow in multiples of this: each new length compiles once
# Compile options for the decode step, per compile (never the global inductor config).
# "triton.cudagraphs" is what mode="reduce-overhead" sets; coordinate-descent tuning tunes the
# batch-1 GEMV/reduction kernels' launch configs (gpt-fast sets it globally).
CUDA_OPTIONS = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
# On the CPU, a C++ wrapper around the step's kernels instead of a Python one: ~100 op calls per
# step from Python cost 0.65-0.9 ms of a 19 ms llama-350m int8 decode step on a 2-core Zen 3
# (RESULTS.md, twentieth session). Its price is compile time: about +10-15 s cold there (the
# wrapper compiled apart from the kernels, at -O1; in one file with them, at -O3, it took 130 s).
CPU_OPTIONS = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
# Prompts up to this wide prefill through CUDA graphs, padded on the right to a multiple of
# PREFILL_ROUND (at most 256 / 16 = 16 graphs per cache shape, sharing one memory pool). Wider
# prompts are compute-bound: launches are a small share of their time. 16, not 32: the padded rows
# are computed too, and int4's kernel is MMA-bound at these widths: Llama-3-8B's 16-token prefill took
# 6.1 ms replayed at width 16 against 8.4 ms at 32 on the H200 (RESULTS.md, forty-third session).
PREFILL_GRAPH_MAX = 256
PREFILL_ROUND = 16


class _Prefill(NamedTuple):
    """A captured prefill and the memory it reads and writes: each tensor must live as long as
    the graph (a freed input's memory would be reused under it)."""
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    positions: torch.Tensor
    last: torch.Tensor
    slots: torch.Tensor
    out: torch.Tensor


class Runner:
    def __init__(self, decoder: FastDecoder, device: torch.device, compile: bool, cudagraphs: bool,
                 max_seq_len: int | None, report):
        self.decoder, self.device = decoder, device
        self.compile, self.cudagraphs = compile, cudagraphs
        self.max_seq_len, self.report = max_seq_len, report
        self._steps: dict = {}  # (kind, width, batch, cache length) -> the step that runs it
        self.options = dict(CUDA_OPTIONS) if cudagraphs else cpu_options() if device.type == "cpu" else {}
        self.prefill_graphs = cudagraphs  # off for good after a failed capture
        self._graphs: dict = {}  # (width, batch, cache length) -> a captured prefill
        self._pool = None

    def __reduce__(self):
        # compiled steps and captured graphs do not pickle: a copied or loaded model builds its own (api.py)
        return _no_runner, ()

    def reserve(self, batch: int, need: int, spare: int = 0) -> None:
        """A cache for ``batch`` rows and ``need`` positions: a clear error past max_seq_len (or the
        model's own limit), else reuse, else (re)allocate rounded up. ``spare``: positions wanted
        beyond ``need`` where the limit leaves room (prompt lookup's padded drafts), never an error."""
        spec = self.decoder.spec
        # Rotary positions go on past max_position_embeddings, as transformers generates there (with a
        # notice; this raised before); a learned position table has no rows beyond it.
        limit = self.max_seq_len or (spec.max_positions if spec.positions == "learned" else None)
        if limit is not None and need > limit:
            what = f"max_seq_len={self.max_seq_len}" if self.max_seq_len else \
                f"the model's max_position_embeddings={spec.max_positions} (a learned position table)"
            raise ValueError(f"prompt plus max_new_tokens is {need} tokens, more than {what}; "
                             "shorten the prompt or max_new_tokens" +
                             (", or pass a larger max_seq_len= to tk.llm.optimize" if self.max_seq_len else ""))
        if need > spec.max_positions and spec.rope_type == "dynamic":
            # transformers' dynamic NTK rope computes a new table for every length past it
            raise Fallback(f"{need} tokens with rope_type='dynamic' past max_position_embeddings="
                           f"{spec.max_positions}, where the rotary table changes with the length")
        if need > spec.max_positions:
            warn_once(f"llm-past-positions:{spec.max_positions}", f"torchkiln.llm: {need} tokens is more than the "
                      f"model's max_position_embeddings={spec.max_positions}; rotary positions go on past it, as "
                      "in transformers, but the model was not trained there")
        d = self.decoder
        need = need + spare if limit is None else max(need, min(limit, need + spare))
        if d.batch == batch and d.seq >= need:
            return
        rounded = -(-need // CACHE_ROUND) * CACHE_ROUND
        seq = self.max_seq_len or (rounded if limit is None else min(limit, rounded))
        d.setup_cache(batch, seq)
        self._graphs.clear()  # they write into the old cache
        self._pool = None  # freed with its last graph: capturing into it again fails an allocator assert
        self.report.cache = {"batch": batch, "seq": seq}

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                graph: bool = True) -> torch.Tensor:
        """The last position's logits for prompt ``ids`` (B, L), its keys and values written
        into cache slots 0..L-1. ``graph=False``: eagerly (the build's checks, which run before
        quantization replaces modules a captured graph would still call)."""
        d = self.decoder
        L = ids.shape[1]
        d.key_ok.fill_(True)
        d.key_ok[:, :L] = mask.bool()
        width = -(-L // PREFILL_ROUND) * PREFILL_ROUND
        if graph and self.prefill_graphs and width <= min(PREFILL_GRAPH_MAX, d.seq):
            entry = self._graphs.get((width, d.batch, d.seq)) or self._capture(width)
            if entry is not None:
                # right padding: its slots L..width-1 get keys no real query reaches (a query
                # attends slots up to its own) and each decode step overwrites before it reads
                entry.tokens.zero_()
                entry.tokens[:, :L] = ids
                entry.positions.zero_()
                entry.positions[:, :L] = positions
                entry.last.fill_(L - 1)
                entry.graph.replay()
                return entry.out.clone()  # the pool's buffer is the next replay's
        return d(ids, torch.arange(L, device=self.device), positions)

    def _capture(self, width: int):
        """A CUDA graph of the eager prefill at ``width``; None (and eager from then on) if
        capture fails."""
        d = self.decoder
        dev = self.device
        tokens = torch.zeros(d.batch, width, dtype=torch.long, device=dev)
        pos = torch.zeros_like(tokens)
        last = torch.zeros(1, dtype=torch.long, device=dev)
        slots = torch.arange(width, device=dev)
        try:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up outside capture: lazy library state
                d(tokens, slots, pos, last=last)
            torch.cuda.current_stream(dev).wait_stream(side)
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with captured(g, self._pool):  # cuBLAS's workspace in this graph's pool: see captured()
                out = d(tokens, slots, pos, last=last)
        except Exception as e:  # noqa: BLE001
            if is_oom(e):
                raise
            self.prefill_graphs = False
            self.report.fallbacks.append(f"prefill CUDA graph -> eager: {first_line(e)}")
            warn_once("llm-prefill-graph", f"torchkiln.llm: capturing the prefill failed ({first_line(e)}); "
                      "prefilling eagerly", owner=self)
            return None
        entry = self._graphs[(width, d.batch, d.seq)] = _Prefill(g, tokens, pos, last, slots, out)
        return entry

    @torch.no_grad()
    def decode(self, token: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self._call("decode", token, slot, pos)

    def verify_fits(self, slot: int, pos: int, width: int) -> bool:
        """Whether a verify of ``width`` tokens at ``slot`` / ``pos`` stays inside the cache (and a
        learned position table): near max_seq_len prompt lookup steps aside for plain decode."""
        spec = self.decoder.spec
        return slot + width <= self.decoder.seq and (spec.positions != "learned" or pos + width <= spec.max_positions)

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
            with quiet_deprecations():  # compiled in this first call (_log.py says why)
                out = step(tokens, slots, positions)
        except Exception as e:  # noqa: BLE001
            if not self.compile or is_oom(e):
                raise
            if self.options.pop("cpp_wrapper", False):  # one level down: the Python wrapper
                self.options.pop("cpp_wrapper_build_separate", None)
                self.report.fallbacks.append(f"compiled {kind} step, C++ wrapper -> Python wrapper: {first_line(e)}")
                warn_once("llm-cpp-wrapper", f"torchkiln.llm: the compiled {kind} step's C++ wrapper failed "
                          f"({first_line(e)}); compiling it with the Python wrapper", owner=self)
                return self._call(kind, tokens, slots, positions)
            self.compile = self.cudagraphs = False
            self.report.fallbacks.append(f"compiled {kind} step -> eager: {first_line(e)}")
            warn_once("llm-compile", f"torchkiln.llm: the compiled {kind} step failed ({first_line(e)}); "
                      "decoding eagerly")
            step = self._build(every=kind == "verify")
            out = step(tokens, slots, positions)
        else:
            if self.compile:
                self.report.compile_s.append(round(time.perf_counter() - t0, 2))
                self.report.wrapper = "C++" if self.options.get("cpp_wrapper") else "Python"
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


def cpu_options() -> dict:
    """CPU_OPTIONS where this torch's inductor has them all (torch.compile rejects an option it
    does not know); else none. Without cpp_wrapper_build_separate (older torch, 2.6 among them)
    the wrapper is compiled with the kernels at -O3, which took the 130 s above: not worth 5%."""
    import torch._inductor.config as inductor

    return dict(CPU_OPTIONS) if all(hasattr(inductor, k) for k in CPU_OPTIONS) else {}


def _no_runner():
    return None
