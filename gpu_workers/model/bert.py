"""BERT encoder (HF ``BertModel``) over packed inputs, and sentence-transformers' pooling on top of it.

A batch is its inputs' tokens laid end to end (``input_ids`` [T], ``lengths`` per input): embeddings,
projections, feed-forward and LayerNorms run on the T real tokens, never on padding. Only attention, which
needs each input's tokens side by side, pads them to the batch's longest ([B, L_max]) and masks the padded
keys; with one input nothing is padded at all.

Precision: weights (and so matmuls) in the model's dtype; the residual stream, LayerNorms and softmax in
fp32, as mixed-precision training runs BERT. In bf16 that keeps each layer's rounding to its matmuls.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpu_workers.encoder_checkpoint import EncoderConfig

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class Packed:
    """Index arithmetic of one packed batch, built once and shared by every layer."""

    def __init__(self, lengths: list[int], device: torch.device):
        self.lengths = lengths
        self.batch = len(lengths)
        self.max_len = max(lengths)
        self.total = sum(lengths)
        lengths_t = torch.tensor(lengths, device=device)
        starts = torch.cumsum(lengths_t, 0) - lengths_t
        self.row = torch.repeat_interleave(torch.arange(self.batch, device=device), lengths_t)  # [T]
        self.positions = torch.arange(self.total, device=device) - starts[self.row]  # [T]
        self.starts = starts
        self.lengths_t = lengths_t
        # Padded keys are masked out of attention: True = attend.
        self.key_mask = (torch.arange(self.max_len, device=device)[None, :] < lengths_t[:, None])[
            :, None, None, :
        ]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, L_max, ...], zeros where an input is shorter."""
        if self.batch == 1:
            return x[None]
        out = x.new_zeros(self.batch, self.max_len, *x.shape[1:])
        out[self.row, self.positions] = x
        return out

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L_max, ...] -> [T, ...]."""
        if self.batch == 1:
            return x[0]
        return x[self.row, self.positions]


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` computed in the weight's dtype, returned in fp32 (the residual stream's)."""
    return F.linear(x.to(layer.weight.dtype), layer.weight, layer.bias).float()


class BertEmbeddings(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # noqa: N815 (HF's name)

    def forward(
        self, input_ids: torch.Tensor, packed: Packed, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids).float() + self.position_embeddings(packed.positions).float()
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0].float()
        else:
            x = x + self.token_type_embeddings(token_type_ids).float()
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = hidden // config.num_heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.qkv: nn.Linear | None = None  # query, key and value as one matmul (fuse(), after loading)

    def fuse(self) -> None:
        fused = nn.Linear(
            self.query.in_features, 3 * self.query.out_features, device=self.query.weight.device
        )
        fused.weight = nn.Parameter(torch.cat([self.query.weight, self.key.weight, self.value.weight]), False)
        fused.bias = nn.Parameter(torch.cat([self.query.bias, self.key.bias, self.value.bias]), False)
        self.qkv = fused
        del self.query, self.key, self.value

    def forward(self, x: torch.Tensor, packed: Packed) -> torch.Tensor:
        if self.qkv is not None:
            qkv = F.linear(x.to(self.qkv.weight.dtype), self.qkv.weight, self.qkv.bias)
        else:
            dtype = self.query.weight.dtype
            qkv = torch.cat(
                [F.linear(x.to(dtype), p.weight, p.bias) for p in (self.query, self.key, self.value)], -1
            )
        # [T, 3, heads, head_dim] -> padded [B, L, 3, heads, head_dim] -> three [B, heads, L, head_dim]
        qkv = packed.pad(qkv.view(packed.total, 3, self.num_heads, self.head_dim))
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        mask = None if packed.batch == 1 else packed.key_mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1 / math.sqrt(self.head_dim))
        return packed.unpad(out.transpose(1, 2)).reshape(packed.total, -1)


class BertSelfOutput(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # noqa: N815


class BertAttention(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, x: torch.Tensor, packed: Packed) -> torch.Tensor:
        attended = self.self(x, packed)
        return self.output.LayerNorm(x + _linear(self.output.dense, attended))


class BertIntermediate(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class BertOutput(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # noqa: N815


class BertLayer(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, packed: Packed) -> torch.Tensor:
        x = self.attention(x, packed)
        dense = self.intermediate.dense
        h = self.act(F.linear(x.to(dense.weight.dtype), dense.weight, dense.bias))
        return self.output.LayerNorm(x + _linear(self.output.dense, h))


class BertEncoder(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))


class BertModel(nn.Module):
    """HF ``BertModel``'s encoder, its tensors under the same names (the pooler is not built: sentence
    embeddings pool the last hidden states themselves)."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def to_compute_dtype(self, dtype: torch.dtype) -> BertModel:
        """Matmul weights in ``dtype``; embeddings and LayerNorms stay fp32 (they are read once per token)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.to(dtype)
        return self

    def fuse_projections(self) -> None:
        for layer in self.encoder.layer:
            layer.attention.self.fuse()

    def forward(
        self, input_ids: torch.Tensor, lengths: list[int], token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Last hidden states [T, hidden] (fp32) of the packed inputs."""
        return self._encode(input_ids, Packed(lengths, input_ids.device), token_type_ids)

    def embed(self, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """One pooled (and, if the checkpoint says so, L2-normalised) fp32 vector per input: [B, hidden]."""
        packed = Packed(lengths, input_ids.device)
        return pool(self._encode(input_ids, packed, None), packed, self.config.pooling, self.config.normalize)

    def _encode(
        self, input_ids: torch.Tensor, packed: Packed, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, packed, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, packed)
        return x


def pool(hidden: torch.Tensor, packed: Packed, mode: str, normalize: bool) -> torch.Tensor:
    if mode == "cls":
        pooled = hidden[packed.starts]
    else:
        sums = hidden.new_zeros(packed.batch, hidden.shape[-1]).index_add_(0, packed.row, hidden)
        pooled = sums / packed.lengths_t[:, None].to(hidden.dtype)
    return F.normalize(pooled, p=2, dim=-1) if normalize else pooled
