"""The lessons' GPT in PyTorch, for `just compare-pytorch`.

nanoGPT's model with nanoGPT's names and shapes (no dropout, biases on,
erf GELU, the lm_head tied to `transformer.wte`), read from a weights file
the lessons write (`fsdp-reference-data`, `fsdp-export`, a lesson's
`weights.safetensors`) and fed the batches a lesson trains on.
"""
import json
import math
import struct

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # nanoGPT's fast path
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))  # erf GELU, as the lessons


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        c = cfg["n_embd"]
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg["vocab_size"], c),
                wpe=nn.Embedding(cfg["block_size"], c),
                h=nn.ModuleList([Block(c, cfg["n_head"]) for _ in range(cfg["n_layer"])]),
                ln_f=nn.LayerNorm(c),
            )
        )
        self.lm_head = nn.Linear(c, cfg["vocab_size"], bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied

    def forward(self, idx, targets):
        B, T = idx.size()
        pos = torch.arange(T, dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        # the loss in fp32, as the lessons compute it (a no-op for fp32 logits; bf16 ones widened)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def read_safetensors(path):
    """(tensors by name, metadata) from a safetensors file, f32 only."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    for name, h in header.items():
        assert h["dtype"] == "F32", f"{path}: {name} is {h['dtype']}, expected F32"
        a, b = h["data_offsets"]
        out[name] = torch.from_numpy(np.frombuffer(data[8 + n + a : 8 + n + b], dtype="<f4").copy()).view(h["shape"])
    return out, meta


def load(path):
    """A GPT with a lessons' weights file's shape and weights."""
    tensors, meta = read_safetensors(path)
    cfg = json.loads(meta["fsdp_gpt"])
    model = GPT(cfg)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected, (missing, unexpected)  # tied: stored once
    return model


def batches(data_dir, meta):
    """Every step's micro-batches: a (steps, M, 2, B, T) int64 tensor."""
    shape = (meta["steps"], meta["micro_batches"], 2, meta["batch_size"], meta["seq_len"])
    raw = np.fromfile(f"{data_dir}/batches.u32", dtype="<u4")
    assert raw.size == math.prod(shape), f"{data_dir}/batches.u32 does not hold {shape}"
    return torch.from_numpy(raw.astype(np.int64)).view(shape)
