"""`torchkiln bench llm`: decode speed of tk.llm against transformers' generate, in one process.

Peers, each generating the same greedy tokens from the same prompt, timed in interleaved
rounds (one call of each per round, medians reported):
- ``hf-eager``: the model's own generate (dynamic cache), the way most users run it;
- ``hf-static``: generate with ``cache_implementation="static"`` (transformers compiles the
  forward itself then, where it decides to);
- ``torchkiln`` (and ``torchkiln-int8`` / ``-int4`` with --quant);
- ``torchkiln-torchgemv`` (and its --quant forms): tk.llm without torchkiln's own CPU GEMV
  (kernels/cpu_gemv.cpp), what that kernel buys.

Per peer: prefill latency (generate of one token), per-token decode latency ((T(n) - T(1)) /
(n - 1)), tokens/s (n / T(n), what users see), the weight bandwidth that decode rate implies
(weight bytes read per token x decode tokens/s; torchkiln's bytes as served, ``decoder_bytes``) and its
share of the device's copy bandwidth (measured before the rounds and again in each, interleaved with the
peers; the median), and the first call's time (compile included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import unittest.mock

import torch

from ..progress import ticks
from ..timing import synchronize

CONFIGS = {  # LlamaConfig fields (another config class where "class" names it); random weights
    "llama-125m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
    "llama-350m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Gemma 3 1B's shape: five sliding-window layers (512, rotary base 10k) to one global (base 1M), four norms a
    # layer, per-head q/k norms, one KV head of 256, a tied 262k-token head
    "gemma-3-1b": dict({"class": "Gemma3TextConfig"}, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                       sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768),
    # Gemma 2 2B's: soft caps on the attention scores (50) and the logits (30), sliding layers of 4096
    "gemma-2-2b": dict({"class": "Gemma2Config"}, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                       query_pre_attn_scalar=256, max_position_embeddings=8192),
}
BITS = {None: None, "int8": 8, "int4": 4.25}  # int4: 4 bits + a bf16 scale and zero per 128 weights


def build(name: str, device: torch.device, dtype: torch.dtype):
    import transformers as T

    fields = dict(CONFIGS[name])
    cfg = getattr(T, fields.pop("class", "LlamaConfig"))(**fields, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = T.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    return model


def copy_bandwidth(device: torch.device) -> float:
    """Bytes moved per second by a large copy (read + write), the practical roofline."""
    n = (256 << 20) if device.type == "cuda" else (64 << 20)
    a, b = torch.randn(n, device=device), torch.empty(n, device=device)
    times = []
    for _ in range(7):
        synchronize(device)
        t = time.perf_counter()
        b.copy_(a)
        synchronize(device)
        times.append(time.perf_counter() - t)
    return 2 * a.numel() * a.element_size() / statistics.median(times[2:])


def weight_bytes(model, quant: str | None) -> int:
    """Bytes of weights one decode step reads: every Linear (the output head included), not the
    embedding table (one row per token)."""
    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            bits = BITS[quant] or m.weight.element_size() * 8
            total += int(m.weight.numel() * bits / 8)
    return total


def decoder_bytes(decoder) -> int:
    """Bytes of weights a torchkiln decode step reads, as served: each projection and the head in
    its own format (int8 codes and scales, int4 packs and tables, float weights), so a head kept in
    float counts at its size."""
    from ..quantization.weight_only import Int4Linear, Int8Linear

    total = 0
    for m in decoder.modules():
        if isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, (Int4Linear, Int8Linear)):
            total += sum(b.numel() * b.element_size() for name, b in m.named_buffers(recurse=False)
                         if name != "bias")
    return total


@dataclasses.dataclass
class Row:
    peer: str
    first_s: float
    prefill_ms: float
    decode_ms: float
    tok_s: float
    gbps: float
    share: float


@contextlib.contextmanager
def _without_own_kernels(on: bool):
    """For the ``torchkiln-torchgemv`` peers: tk.llm built as if torchkiln's CPU GEMV could not be
    built here, so its decode uses torch's kernels only (what torchkiln's own kernel buys)."""
    from ..kernels import cpu_gemv

    off = unittest.mock.patch.object(cpu_gemv, "load", lambda: "left out for this peer")
    with off if on else contextlib.nullcontext():
        yield


PEERS = ("hf-eager", "hf-static", "torchkiln", "torchkiln-torchgemv")  # the last: torch's kernels only


def run(name: str = "llama-125m", device="cpu", dtype=torch.float32, quant=(), batch: int = 1,
        prompt: int = 16, new: int = 128, rounds: int = 5, peers=PEERS[:3],
        progress: bool = True, lookup: int = 0) -> tuple[list, dict]:
    """``lookup``: also time prompt-lookup speculation (transformers' and torchkiln's) with this
    many drafted tokens, on a prompt that repeats itself (the case prompt lookup is for)."""
    import torchkiln as tk

    device = torch.device(device)
    model = build(name, device, dtype)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    if lookup:  # a repeating prompt: random weights give no natural text to look up
        ids = ids[:, :max(2, prompt // 4)].repeat(1, 4)[:, :prompt]
    ids = ids.to(device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    gens, wbytes, first = {}, {}, {}

    def add(peer, fn, nbytes):
        gens[peer], wbytes[peer] = fn, nbytes

    base = weight_bytes(model, None)
    if "hf-eager" in peers:
        add("hf-eager", lambda n: model.generate(ids, max_new_tokens=n, **kw), base)
    if "hf-static" in peers:
        add("hf-static", lambda n: model.generate(ids, max_new_tokens=n, cache_implementation="static", **kw), base)
    fast = {}
    for base_peer in ("torchkiln", "torchkiln-torchgemv"):
        for q in (None, *quant) if base_peer in peers else ():
            peer = base_peer + (f"-{q}" if q else "")
            t = time.perf_counter()
            with _without_own_kernels(base_peer != "torchkiln"):
                fast[peer] = tk.llm.optimize(model, dtype=dtype, quant=q, device=device, max_seq_len=None)
            first[peer] = time.perf_counter() - t  # setup; the first generate is added below
            runner = getattr(fast[peer], "_kiln_runner", None)  # None: the stock path
            nbytes = decoder_bytes(runner.decoder) if runner is not None else weight_bytes(model, q)
            add(peer, (lambda m: lambda n: m.generate(ids, max_new_tokens=n, **kw))(fast[peer]), nbytes)
    if lookup:
        add("hf-eager+lookup", lambda n: model.generate(ids, max_new_tokens=n, prompt_lookup_num_tokens=lookup, **kw),
            base)
        if "torchkiln" in fast:
            add("torchkiln+lookup", lambda n: fast["torchkiln"].generate(ids, max_new_tokens=n,
                                                                         prompt_lookup_num_tokens=lookup, **kw), base)
    # measured again in every round, interleaved with the peers, and the median taken: on a shared
    # 2-core host one measurement read 20.5-30.4 GB/s across four back-to-back runs (RESULTS.md,
    # twentieth session), which moved the "% of copy bw" of an unchanged peer by 15 points
    bws = [copy_bandwidth(device)]
    reference, ref_peer = None, ""
    # a bar on stderr, as the other benchmarks: stdout carries only the table (or the JSON)
    with ticks(progress, "LLM bench: first calls, rounds", len(gens) + rounds) as tick:
        for peer, fn in gens.items():  # first calls: compile, and a check that every peer decodes the same
            synchronize(device)
            t = time.perf_counter()
            out = fn(new)
            synchronize(device)
            first[peer] = first.get(peer, 0.0) + time.perf_counter() - t
            fn(1)
            if reference is None:
                reference, ref_peer = out, peer
            elif not peer.endswith(("int8", "int4")) and not torch.equal(out, reference):
                # bf16 kernels may flip a near-tie on random weights; count, do not hide
                first[f"{peer} (tokens differ from {ref_peer})"] = float((out != reference).sum())
            if tick:
                tick()
        times = {p: {"n": [], "1": []} for p in gens}
        for _ in range(rounds):
            bws.append(copy_bandwidth(device))
            for peer, fn in gens.items():
                for key, n in (("n", new), ("1", 1)):
                    synchronize(device)
                    t = time.perf_counter()
                    fn(n)
                    synchronize(device)
                    times[peer][key].append(time.perf_counter() - t)
            if tick:
                tick()
    bw = statistics.median(bws)
    rows = []
    for peer in gens:
        tn, t1 = statistics.median(times[peer]["n"]), statistics.median(times[peer]["1"])
        dec = (tn - t1) / (new - 1)
        gbps = wbytes[peer] / dec / 1e9
        rows.append(Row(peer, round(first[peer], 1), t1 * 1e3, dec * 1e3, batch * new / tn, gbps, gbps * 1e9 / bw))
    info = {"model": name, "device": str(device), "dtype": str(dtype).removeprefix("torch."), "batch": batch,
            "prompt": prompt, "new_tokens": new, "rounds": rounds, "copy_GBps": round(bw / 1e9, 1),
            "copy_GBps_range": [round(min(bws) / 1e9, 1), round(max(bws) / 1e9, 1)],
            "weight_GB": round(base / 1e9, 3), "notes": {k: v for k, v in first.items() if "differ" in k},
            "reports": {p: m.kiln_report.to_dict() for p, m in fast.items()}, "lookup": lookup}
    return rows, info


def table(rows: list, info: dict) -> str:
    base = next((r for r in rows if r.peer == "hf-eager"), rows[0])
    lines = [f"{info['model']} on {info['device']}, {info['dtype']}, batch {info['batch']}, prompt {info['prompt']}, "
             f"{info['new_tokens']} new tokens, {info['rounds']} rounds; copy bandwidth {info['copy_GBps']} GB/s "
             f"(median of {info['rounds'] + 1}, {'-'.join(map(str, info.get('copy_GBps_range', [])))}), "
             f"weights {info['weight_GB']} GB",
             f"| peer | first call s | prefill ms | decode ms/token | tok/s | x {base.peer} | weight GB/s | % of copy bw |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.peer} | {r.first_s:.1f} | {r.prefill_ms:.1f} | {r.decode_ms:.2f} | {r.tok_s:.1f} | "
                     f"{r.tok_s / base.tok_s:.2f} | {r.gbps:.1f} | {100 * r.share:.0f}% |")
    if info.get("lookup"):
        rep = info["reports"].get("torchkiln", {})
        lines.append(f"prompt lookup: {info['lookup']} drafted tokens per step, on a prompt that repeats; torchkiln "
                     f"kept {rep.get('accepted', 0)} of its drafts over {rep.get('speculated', 0)} speculative "
                     "steps (all calls); per-token decode ms for +lookup rows is per generated token")
    for k, v in info["notes"].items():
        lines.append(f"note: {k}: {v:.0f} tokens")
    return "\n".join(lines)
