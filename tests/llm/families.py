"""Tiny random-init configs of every supported family (CPU tests), with a peaked output
head so greedy never hinges on a near-tie."""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _configs():
    import transformers as T

    gqa = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256)
    return {
        "llama": (T.LlamaConfig, gqa),
        "mistral": (T.MistralConfig, dict(gqa, sliding_window=4096)),
        "qwen2": (T.Qwen2Config, gqa),
        "qwen3": (T.Qwen3Config, dict(gqa, head_dim=16)),
        "phi3": (T.Phi3Config, gqa),
        "gemma": (T.GemmaConfig, dict(gqa, head_dim=16)),
        # Gemma 2/3: four norms a layer; 2 with its soft caps (defaults 50 and 30), 3 with per-head q/k norms
        # and a second rotary table for its sliding layers
        "gemma2": (T.Gemma2Config, dict(gqa, head_dim=16)),
        "gemma3": (T.Gemma3TextConfig, dict(gqa, head_dim=16, layer_types=["sliding_attention", "full_attention"])),
        "gpt2": (T.GPT2Config, dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
        "gpt_neox": (T.GPTNeoXConfig, dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=256)),
        "opt": (T.OPTConfig, dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                                  max_position_embeddings=256, word_embed_proj_dim=64)),
    }


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "gpt2", "gpt_neox", "opt")


def build(name: str, seed: int = 0, peak: float = 4.0, **sizes):
    """A random model of family ``name``; ``sizes`` override its config's fields (hidden_size=...)."""
    import transformers as T

    cls, kw = _configs()[name]
    torch.manual_seed(seed)
    config = cls(**{**kw, **sizes}, **COMMON)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # random-init weights are small; make every layer matter
            if p.dim() == 2:
                p.normal_(0, 0.08)
        head = model.get_output_embeddings()
        if head.weight is model.get_input_embeddings().weight:  # tied: untie so the peak does not scale inputs
            head.weight = torch.nn.Parameter(head.weight.detach().clone())
            model.config.tie_word_embeddings = False
        head.weight.mul_(peak)
    return model


def longrope(long_factor, short_factor=None):
    """Phi-3.5's rope on a family config: the short table up to position 12, ``long_factor``'s past it
    (``type``: the key transformers 4.x checks; 5.x reads it too)."""
    short = short_factor or [1.0 + 0.2 * i for i in range(8)]
    return dict(original_max_position_embeddings=12,
                rope_scaling=dict(type="longrope", short_factor=short, long_factor=long_factor))
