"""generate() for the fast path: transformers' argument handling, prefill + decode over the
static cache, stop tokens, left-padded batches, streaming, and a named fallback to the
model's own generate for anything the fast path does not do."""

from __future__ import annotations

import dataclasses
import functools

import torch

from .sampling import Sampling, choose, process

# transformers' defaults for what a GenerationConfig leaves unset (its
# _get_default_generation_params); repeated so older transformers versions resolve the same
DEFAULTS = {"max_length": 20, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
            "repetition_penalty": 1.0, "min_new_tokens": 0}
TAKEN = ("max_new_tokens", "max_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
         "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id", "output_scores", "output_logits",
         "return_dict_in_generate", "prompt_lookup_num_tokens", "max_matching_ngram_size")
# generation settings the fast path does not implement, with the values that leave them off (None
# always does). Per setting: a token id of 0 or 1 is a real forced token (Gemma's eos is 1, GPT-NeoX's
# 0), max_time=0 stops at once and guidance_scale=0 keeps only the unconditional logits, so those are
# not off; one rule for all had dropped them silently (a new-user probe, 2026-11-26).
EMPTY = ([], ())
NEUTRAL = {"num_beams": (1,), "num_return_sequences": (1,), "penalty_alpha": (0,), "no_repeat_ngram_size": (0,),
           "bad_words_ids": EMPTY, "force_words_ids": EMPTY, "constraints": EMPTY, "min_p": (0,),
           "typical_p": (1,), "epsilon_cutoff": (0,), "eta_cutoff": (0,), "renormalize_logits": (False,),
           "suppress_tokens": EMPTY, "begin_suppress_tokens": EMPTY, "sequence_bias": ({},),
           "guidance_scale": (1,), "watermarking_config": (), "forced_bos_token_id": (), "forced_eos_token_id": (),
           "exponential_decay_length_penalty": (), "stop_strings": EMPTY, "output_attentions": (False,),
           "output_hidden_states": (False,), "min_length": (0,), "max_time": (), "num_beam_groups": (1,),
           "diversity_penalty": (0,), "dola_layers": (), "top_h": (), "encoder_repetition_penalty": (1,),
           "low_memory": (False,), "min_tokens_to_keep": (1,)}
# generate() keywords outside GenerationConfig that only the model's own generate understands
FOREIGN = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model",
           "negative_prompt_ids", "negative_prompt_attention_mask", "past_key_values", "inputs_embeds",
           "synced_gpus", "tokenizer", "assistant_tokenizer", "custom_generate", "position_ids",
           "cache_position", "token_type_ids")
IGNORED = ("use_cache", "cache_implementation", "compile_config", "disable_compile", "streamer_timeout")


class Fallback(Exception):
    """This call goes to the model's own generate; the message names the argument."""


@dataclasses.dataclass(frozen=True)
class Request:
    max_new_tokens: int
    sampling: Sampling
    pad: int | None
    output_scores: bool
    output_logits: bool
    return_dict: bool
    lookup: int = 0   # prompt lookup: tokens speculated per step (transformers' prompt_lookup_num_tokens)
    ngram: int = 2    # longest n-gram matched (max_matching_ngram_size)


def _is_off(value, offs: tuple) -> bool:
    """``value`` leaves its setting off: None, or equal to one of ``offs`` (a plain value: a tensor or
    a config object is never off)."""
    return value is None or (isinstance(value, (bool, int, float, str, list, tuple, dict)) and value in offs)


@functools.cache
def _library_max_length():
    """transformers' own GenerationConfig default for max_length: 20 in 4.x, None in 5.x (read once:
    building a GenerationConfig on every generate() call is work for nothing)."""
    try:
        import transformers

        return transformers.GenerationConfig().max_length
    except Exception:  # noqa: BLE001 - no transformers (a duck-typed model): nothing to mirror
        return None


def resolve(model, prompt_len: int, generation_config, kwargs: dict) -> Request:
    """Merge kwargs over generation_config over the model's generation_config over
    transformers' defaults; raise Fallback naming an argument the fast path does not take."""
    for key in FOREIGN:
        if kwargs.get(key) is not None:
            raise Fallback(f"{key}=")
    layers = [vars(generation_config) if generation_config is not None else {},
              vars(getattr(model, "generation_config", None) or object())]

    def configured(name):
        """A config's value (generation_config=, then the model's); None there means "not set"."""
        return next((layer[name] for layer in layers if layer.get(name) is not None), None)

    def get(name, default=None):
        # transformers applies generate()'s keywords last, None included: eos_token_id=None turns eos
        # stopping off and top_k=None top-k (read as "not set", the fast path stopped at the model's
        # eos and sampled from the top 50: the new-user sweep, 2026-11-23). Configs only fill gaps.
        if name in kwargs:
            return kwargs[name]
        v = configured(name)
        return DEFAULTS.get(name, default) if v is None else v

    def num(name):  # a number passed as None is off, which is its default
        v = get(name)
        return DEFAULTS[name] if v is None else v

    for key, offs in NEUTRAL.items():
        v = get(key)
        if not _is_off(v, offs):
            raise Fallback(f"{key}={v!r}")
    unknown = set(kwargs) - set(TAKEN) - set(NEUTRAL) - set(FOREIGN) - set(IGNORED)
    if unknown:
        raise Fallback(f"{sorted(unknown)[0]}=")
    # transformers merges the keywords into the config, then max_new_tokens, wherever it was set, wins
    # over max_length (a max_length= keyword against a config's max_new_tokens gave 15 tokens where
    # transformers gives 11: the new-user probe, 2026-11-26)
    new = kwargs["max_new_tokens"] if "max_new_tokens" in kwargs else configured("max_new_tokens")
    if new is not None and new < 1:
        raise ValueError(f"max_new_tokens={new} must be at least 1")
    max_length = None
    if new is None:
        max_length = kwargs.get("max_length")
        if max_length is None:
            max_length = configured("max_length")
            if max_length is not None and max_length == _library_max_length():
                # transformers 4.x: every config carries its default max_length=20, and generate reads
                # a config's max_length equal to that default as unset (prompt + 20, not 20 in all)
                max_length = None
    if new is None and max_length is None:
        # nothing set anywhere: transformers adds its default 20 tokens to the prompt (not 20 in all),
        # within the model's positions
        new = DEFAULTS["max_length"]
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if limit is not None and limit - prompt_len < new:
            new, max_length = limit - prompt_len, limit  # what the message below names, as transformers does
    elif new is None:
        new = max_length - prompt_len
    if new < 1:
        raise ValueError(f"the prompt has {prompt_len} tokens, not fewer than max_length={max_length}; "
                         "pass max_new_tokens= (the number of tokens to add)")
    eos = get("eos_token_id")
    if isinstance(eos, torch.Tensor):  # transformers takes a tensor of ids too
        eos = eos.flatten().tolist()
    eos = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    do_sample = bool(get("do_sample"))
    sampling = Sampling(do_sample=do_sample, temperature=float(num("temperature")),
                        top_k=int(get("top_k")) if do_sample and get("top_k") else None,
                        top_p=float(num("top_p")) if do_sample else None,
                        repetition_penalty=float(num("repetition_penalty")),
                        min_new_tokens=int(num("min_new_tokens")), eos=eos)
    pad = get("pad_token_id")
    lookup, ngram = int(get("prompt_lookup_num_tokens", 0) or 0), int(get("max_matching_ngram_size", 2) or 2)
    if lookup < 0 or ngram < 1:
        raise ValueError(f"prompt_lookup_num_tokens={lookup} must be >= 0 and max_matching_ngram_size={ngram} >= 1")
    return Request(int(new), sampling, None if pad is None else int(pad), bool(get("output_scores", False)),
                   bool(get("output_logits", False)), bool(get("return_dict_in_generate", False)), lookup, ngram)


def inferred_mask(ids: torch.Tensor, pad: int | None, eos: tuple) -> torch.Tensor | None:
    """The attention mask transformers' generate infers when none is given: a pad token that is not
    an eos token and occurs in the prompt marks padding (``_prepare_attention_mask_for_generation``).
    Without it, a left-padded prompt decoded as if its pads were text (wrong tokens; the new-user
    sweep, 2026-11-22)."""
    if pad is None or pad in eos or not bool((ids == pad).any()):
        return None
    return ids.ne(pad).long()


def left_padding(mask: torch.Tensor) -> torch.Tensor:
    """Pad count per row; Fallback for a mask that is not left padding (zeros after ones)."""
    m = mask.bool()
    if bool((m[:, 1:].int() < m[:, :-1].int()).any()):
        raise Fallback("attention_mask= with right padding (the fast path decodes left-padded batches; "
                       "set tokenizer.padding_side='left')")
    return (~m).sum(dim=1)


def lookup(seq: list, k: int, ngram: int) -> list:
    """Prompt lookup (transformers' PromptLookupCandidateGenerator): the k tokens that followed
    the earliest earlier occurrence of the sequence's last n-gram, longest n-gram first."""
    n_seq = len(seq)
    for n in range(min(ngram, n_seq - 1), 0, -1):
        tail = seq[-n:]
        for start in range(n_seq - n):
            if seq[start:start + n] == tail and start + n < n_seq:
                return seq[start + n:start + n + k]
    return []


def _speculate(runner, seq, nxt, slot, pos, req: Request, room: int):
    """One prompt-lookup step for a single greedy row: verify up to ``req.lookup`` drafted tokens
    after ``nxt`` in one forward. Returns (accepted tokens, logits after the last one), or None
    when nothing was drafted. Exact under greedy: a drafted token is kept only if it is the
    model's own argmax at its position, and the next logits come from that same forward."""
    if not runner.verify_fits(int(slot), int(pos[0, 0]), req.lookup + 1):
        return None
    draft = lookup(seq[0].tolist(), min(req.lookup, room), req.ngram)
    if not draft:
        return None
    padded = draft + [draft[-1]] * (req.lookup - len(draft))  # a fixed width: one compiled shape
    tokens = torch.tensor([[int(nxt[0])] + padded], device=seq.device)
    every = runner.verify(tokens, slot, pos)[0]
    preds = every.argmax(dim=-1).tolist()
    kept = 0
    while kept < len(draft) and preds[kept] == draft[kept]:
        kept += 1
    return draft[:kept], every[kept:kept + 1]


def lagged(dev: torch.device, streamer, speculate: bool, req: Request) -> bool:
    """Whether generate reads "every row has stopped" one token late (StopCheck): on CUDA, where
    reading it at once is a sync per token. Not with a streamer (it copies each token to the
    host anyway), prompt lookup (it syncs on its drafts), or per-token scores/logits asked for."""
    return dev.type == "cuda" and streamer is None and not speculate and not req.output_scores \
        and not req.output_logits


class StopCheck:
    """"Has every row stopped?" read one token late, so the GPU is never left idle waiting for it.
    Read at once (``bool(done.all())``), it waited for the GPU to finish each token, and the host
    work before the next step (sampling's launches, the compiled step's guards, the graph replay)
    then ran with the GPU idle: Llama-3-8B on the H200 decoded 195.0 tok/s with a stop token
    against 228.2 without in bf16, 249.7 against 314.7 in int8 (benchmarks/RESULTS.md, twentieth
    session). The flag is copied to pinned memory behind an event; the next token waits for that
    event only, while the decode step queued after it runs. A row that stopped is padded, so the
    one token too many is all padding, and is dropped."""

    def __init__(self, dev: torch.device):
        self.flag = torch.zeros((), dtype=torch.bool, pin_memory=dev.type == "cuda")
        self.event = torch.cuda.Event() if dev.type == "cuda" else None
        self.waiting = False

    def queue(self, all_done: torch.Tensor) -> None:
        self.flag.copy_(all_done, non_blocking=True)
        if self.event is not None:
            self.event.record()
        self.waiting = True

    def stopped(self) -> bool:
        if not self.waiting:
            return False
        if self.event is not None:
            self.event.synchronize()
        return bool(self.flag)


def run(runner, ids: torch.Tensor, mask: torch.Tensor | None, req: Request, streamer=None, generator=None):
    """Prefill, then one token per step until max_new_tokens or every row has stopped.
    Returns (sequences, scores, logits) with scores/logits lists (empty unless asked)."""
    B, L = ids.shape
    if mask is None:
        mask = torch.ones_like(ids)
    left_padding(mask)  # right padding: Fallback
    s = req.sampling
    pad = req.pad
    # With no pad and no eos token a left-padded batch still decodes, as in transformers: no row stops
    # early, so no row is ever padded after its end (this raised before: the tk.llm probe, 2026-11-26).
    if pad is None and s.eos:
        pad = s.eos[0]  # transformers does the same (with a warning) when rows stop at different steps
    speculate = (req.lookup > 0 and B == 1 and not s.do_sample and s.repetition_penalty == 1.0
                 and not req.output_logits and not req.output_scores)
    after = runner.decoder.spec.long_after
    if after is not None and L <= after and L + req.max_new_tokens >= after + 2:
        # transformers' Phi-3 drops its cache where the sequence first passes original_max_position_embeddings
        # and runs the whole sequence again with the long rotary table; the call is the model's own generate
        raise Fallback(f"a request of {L} + {req.max_new_tokens} tokens passing the longrope switch at "
                       f"original_max_position_embeddings={after}")
    # prompt lookup's verify writes req.lookup + 1 slots from the current one: spare room where there is
    # some; a request that fits without it is never refused for it (it raised near max_seq_len)
    runner.reserve(B, L + req.max_new_tokens, spare=req.lookup if speculate else 0)
    dev = runner.device
    ids = ids.to(dev)
    mask = mask.to(dev)
    # transformers' positions: cumulative count of real tokens, minus one (padding: 0 here, unread)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    if streamer is not None:
        streamer.put(ids.cpu())
    logits = runner.prefill(ids, mask, positions)
    seq = ids
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    stops = torch.tensor(s.eos, device=dev) if s.eos else None  # made once, not per token
    scores_out, logits_out = [], []
    slot = torch.tensor([L], device=dev)
    pos = positions[:, -1:] + 1
    late = StopCheck(dev) if lagged(dev, streamer, speculate, req) else None
    i = 0
    while i < req.max_new_tokens:
        if req.output_logits:
            logits_out.append(logits.clone())
        scores = process(logits, seq, i, s, stops)
        if req.output_scores:
            scores_out.append(scores.clone())
        nxt = choose(scores, s, generator)
        if pad is not None:
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        if streamer is not None:
            streamer.put(nxt.cpu())
        i += 1
        if s.eos:
            done = done | torch.isin(nxt, stops)
            if late is not None:
                if late.stopped():  # every row had stopped at the previous token: this one is padding
                    seq = seq[:, :-1]
                    break
                late.queue(done.all())
            elif bool(done.all()):
                break
        if i >= req.max_new_tokens:
            break
        room = req.max_new_tokens - i
        step = _speculate(runner, seq, nxt, slot, pos, req, room) if speculate and i >= s.min_new_tokens else None
        if step is None:
            logits = runner.decode(nxt[:, None], slot, pos)
            slot += 1
            pos += 1
            continue
        kept, logits = step
        runner.report.speculated += 1
        runner.report.accepted += len(kept)
        slot += 1 + len(kept)
        pos += 1 + len(kept)
        if kept:
            extra = torch.tensor([kept], device=dev)
            if s.eos and any(t in s.eos for t in kept):  # stop at the first stop token, as token-by-token would
                extra = extra[:, :next(j for j, t in enumerate(kept) if t in s.eos) + 1]
                done[:] = True
            seq = torch.cat([seq, extra], dim=1)
            i += extra.shape[1]
            if streamer is not None:
                streamer.put(extra[0].cpu())
            if bool(done.all()):
                break
    if streamer is not None:
        streamer.end()
    return seq, scores_out, logits_out
