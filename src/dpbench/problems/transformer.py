"""P4: a decoder-only transformer language model over bytes, in the style of nanoGPT
(Radford et al., 2019, GPT-2; Karpathy's nanoGPT), trained privately one record per sample.

Architecture: token embedding + learned position embedding, ``n_layers`` pre-LayerNorm blocks
``x + attn(ln1(x))``, ``x + mlp(ln2(x))`` with causal multi-head self-attention (q, k, v and
output projections as ``nn.Linear``; the attention itself is
``F.scaled_dot_product_attention(..., is_causal=True)``, which has no parameters) and an MLP
Linear-GELU-Linear, a final LayerNorm and an untied ``nn.Linear`` output head. No dropout
(dropout would be one more source of randomness for the privacy analysis to account for, and is
off in DP training). Every trainable layer is a Linear, Embedding or LayerNorm, the layers whose
per-sample gradients ``dpbench.privacy.per_sample`` forms; no weights are tied (a tied
embedding/head pair would sum two layers' contributions in one per-sample gradient).

At the defaults (vocab 258 = 256 bytes + PAD 256 + BOS/EOS 257, context 128, d_model 128,
4 layers, 4 heads, MLP width 512) the model has 876,034 parameters (checked by the tests):
embeddings 258*128 + 128*128 = 49,408; per block 2*256 (LayerNorms) + 4*(128*128 + 128)
(attention) + (128*512 + 512) + (512*128 + 128) (MLP) = 198,272, times 4 = 793,088; final
LayerNorm 256; head 128*258 + 258 = 33,282.

Per-sample loss (``token_losses``): each record's loss is the mean next-token cross-entropy over
its real (non-PAD) target tokens, so clipping bounds each record's contribution whatever its
length, and padding a batch to a longer length changes no record's loss or gradient: the model is
causal, so real positions never see the (later) padded ones, and padded targets carry no loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Why the classes below may declare ``per_sample_forward = True`` (per_sample.check_per_sample):
# their forward code only reshapes along the feature/head axes, adds residuals and calls
# scaled_dot_product_attention, which attends within each sample's own sequence (axis 0 is
# batched over, never reduced); nothing is averaged or normalised across the batch.


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v and output projections."""

    per_sample_forward = True  # attention mixes positions of one sample, never samples (see above)

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        heads = lambda t: t.view(B, T, self.n_heads, d // self.n_heads).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    per_sample_forward = True  # residual sums of per-sample layers (see above)

    def __init__(self, d_model: int, n_heads: int, d_mlp: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_mlp), nn.GELU(), nn.Linear(d_mlp, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    """P4: tokens (B, T) int64 -> next-token logits (B, T, vocab_size)."""

    per_sample_forward = True  # embeddings, per-sample blocks, LayerNorm and head (see above)

    def __init__(self, vocab_size: int = 258, context: int = 128, d_model: int = 128, n_layers: int = 4,
                 n_heads: int = 4, d_mlp: int = 512):
        super().__init__()
        self.context = context
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_mlp) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)  # untied from tok_emb

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(tokens))

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final LayerNorm's output (B, T, d_model): what the head reads at each position."""
        B, T = tokens.shape
        if T > self.context:
            raise ValueError(f"sequence length {T} exceeds the context {self.context}")
        # positions expanded to (B, T), not a shared (T,) row: the per-sample engine reads axis 0
        # of every layer's input as the sample axis
        pos = torch.arange(T, device=tokens.device).expand(B, T)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def token_losses(logits: torch.Tensor, targets: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Per-record loss (B,): the mean next-token cross-entropy over the record's real targets
    (``targets != pad_id``). A record with no real target has loss 0 (and gradient 0)."""
    ce = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=pad_id, reduction="none")  # (B, T)
    real = (targets != pad_id).sum(1).clamp(min=1)
    return ce.sum(1) / real
