"""The trainable model: the serving Llama itself, run over fixed-length batches with causal attention.

Training the very module that serves (``gpu_workers.model.llama``) means the saved tensor names and the
numerics are the ones the loader and Engine use; only the attention backend differs (no paged cache).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn

from gpu_workers.checkpoint import ModelConfig
from gpu_workers.kernels.rotary import apply_rotary
from gpu_workers.model.llama import LlamaForCausalLM
from gpu_workers.tools.train.data import BOS_ID, EOS_ID, PAD_ID

# A code model's chat: the user's message is the code to continue and the assistant's turn continues it, so
# turns join with nothing between them; a system message becomes a leading comment block. The generation
# prompt adds nothing: the model picks up exactly where the user's code stops.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '# ' + message['content'].strip().replace('\\n', '\\n# ') + '\\n' }}"
    "{% else %}"
    "{{ message['content'] }}"
    "{% endif %}"
    "{% endfor %}"
)


class CausalAttention:
    """The engine's attention interface over a [batch, seq_len] block of fresh tokens (no KV cache)."""

    # The layers' norms run the torch references: autograd records them (the kernels record nothing).
    backend = "reference"

    def __init__(self, batch: int, seq_len: int):
        self.batch = batch
        self.seq_len = seq_len

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if sliding_window is not None:
            raise ValueError("CausalAttention attends over the whole block; it has no sliding window")
        if rotary is not None:  # q and k still to be rotated, as the engine's attention takes them
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (
            t.view(self.batch, self.seq_len, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(self.batch * self.seq_len, o.shape[1], o.shape[3])

    def rotate_and_attend(
        self,
        layer: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: int,
        kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``self(...)`` from a fused q/k/v projection's output [T, (heads + 2 kv_heads) * dim], q and k to be
        rotated by ``cos``/``sin`` (the engine's attention interface for a model with fused projections)."""
        dim = cos.shape[1]
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        shaped = (q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim))
        return self(layer, *shaped, scale, sliding_window, rotary=(cos, sin))


def hf_config(
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    context: int,
    rope_theta: float = 10000.0,
) -> dict:
    """config.json as transformers writes it for a tied-embedding Llama saved in bfloat16."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": "bfloat16",
    }


def build_model(config: dict, seed: int) -> LlamaForCausalLM:
    """A freshly initialised model: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2 layers)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(ModelConfig.from_dict(config))
    residual_std = 0.02 / math.sqrt(2 * config["num_hidden_layers"])
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(param)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            nn.init.normal_(param, std=residual_std)
        else:
            nn.init.normal_(param, std=0.02)
    return model


def loss_fn(
    model: LlamaForCausalLM, inputs: torch.Tensor, targets: torch.Tensor, unlikelihood: float = 0.0
) -> torch.Tensor:
    """Mean next-token cross-entropy of [batch, seq_len] inputs against their targets; with ``unlikelihood``
    > 0, plus that weight times the token-level unlikelihood loss (``unlikelihood_loss``)."""
    batch, seq_len = inputs.shape
    logits = model.compute_logits(_hidden(model, inputs).reshape(batch * seq_len, -1))
    if unlikelihood <= 0:
        return F.cross_entropy(logits, targets.reshape(-1))
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # one softmax for both terms
    loss = F.nll_loss(log_probs, targets.reshape(-1))
    return loss + unlikelihood * unlikelihood_loss(log_probs.view(batch, seq_len, -1), inputs, targets)


def unlikelihood_loss(log_probs: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-level unlikelihood (Welleck et al., 2019, "Neural Text Generation with Unlikelihood Training"):
    at each position, ``-sum log(1 - p(c))`` over the candidates c, the tokens already in the window up to and
    including the current input that are not the target; the mean over positions. It lowers the probability
    of repeating what the context holds unless the data repeats it, which is what makes greedy decoding loop.

    ``log_probs`` [batch, seq_len, vocab] (log-softmax of the logits); ``inputs``, ``targets`` [batch, seq_len]."""
    batch, seq_len, vocab = log_probs.shape
    # Where each vocabulary entry first appears in the window (seq_len if never): seen at t when first <= t.
    first = torch.full((batch, vocab), seq_len, dtype=torch.long, device=inputs.device)
    first.scatter_reduce_(1, inputs, torch.arange(seq_len, device=inputs.device).expand(batch, -1), "amin")
    seen = first.unsqueeze(1) <= torch.arange(seq_len, device=inputs.device).view(1, -1, 1)
    seen.scatter_(2, targets.unsqueeze(-1), False)
    return -torch.where(seen, _log_one_minus(log_probs.exp()), 0.0).sum() / targets.numel()


def _hidden(model: LlamaForCausalLM, rows: torch.Tensor) -> torch.Tensor:
    """[batch, seq_len, hidden]: the model's causal forward pass over each [batch, seq_len] row from position 0."""
    batch, seq_len = rows.shape
    positions = torch.arange(seq_len, device=rows.device).repeat(batch)
    return model(rows.reshape(-1), positions, CausalAttention(batch, seq_len)).view(batch, seq_len, -1)


def _log_one_minus(probs: torch.Tensor) -> torch.Tensor:
    """log(1 - p), kept finite where p rounds to 1."""
    return torch.log1p(-probs.clamp(max=1.0 - 1e-5))


def save_checkpoint(model: LlamaForCausalLM, config: dict, tokenizer: Tokenizer, out: Path) -> None:
    """Write the Hugging Face folder: config.json, bf16 model.safetensors, tokenizer and generation files.
    The weights are saved from CPU copies, so the folder is the same whichever device trained it."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: p.detach().to("cpu", torch.bfloat16).contiguous() for name, p in model.state_dict().items()
    }
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "model_max_length": config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    for name, data in (
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("generation_config.json", generation),
    ):
        (out / name).write_text(json.dumps(data, indent=2) + "\n")


@torch.no_grad()
def greedy_continuations(model: LlamaForCausalLM, prefixes: torch.Tensor, length: int) -> torch.Tensor:
    """[batch, prefix + length]: each prefix row and its greedy continuation of ``length`` tokens (the whole
    sequence recomputed per token: no KV cache, so it runs on the training module as it is)."""
    was_training = model.training
    model.eval()
    rows = prefixes
    for _ in range(length):
        last = _hidden(model, rows)[:, -1]
        rows = torch.cat([rows, model.compute_logits(last).argmax(-1, keepdim=True)], dim=1)
    model.train(was_training)
    return rows


def repeated_ngram_mask(tokens: torch.Tensor, n: int = 4) -> torch.Tensor:
    """[batch, length] bool: the tokens of each n-gram that already occurred earlier in the same row."""
    mask = torch.zeros(tokens.shape, dtype=torch.bool)
    for row, values in enumerate(tokens.tolist()):
        seen: set[tuple[int, ...]] = set()
        for i in range(len(values) - n + 1):
            gram = tuple(values[i : i + n])
            if gram in seen:
                mask[row, i : i + n] = True
            seen.add(gram)
    return mask


def sequence_unlikelihood_loss(
    model: LlamaForCausalLM, prefixes: torch.Tensor, length: int, n: int = 4
) -> tuple[torch.Tensor, float]:
    """Sequence-level unlikelihood (Welleck et al., 2019): continue each prefix greedily, then lower the
    probability of every continuation token that is part of a repeated n-gram: ``-log(1 - p(token))`` summed
    over those tokens, divided by the continuation tokens. Also the share of tokens that were repeats."""
    rows = greedy_continuations(model, prefixes, length)
    start = prefixes.shape[1]
    continuation = rows[:, start:]
    flagged = repeated_ngram_mask(continuation.cpu(), n).to(rows.device)
    # The positions that predict the continuation: from the prefix's last token to the one before the end.
    hidden = _hidden(model, rows[:, :-1])[:, start - 1 :]
    log_probs = torch.log_softmax(model.compute_logits(hidden.reshape(-1, hidden.shape[-1])).float(), dim=-1)
    chosen = log_probs.gather(1, continuation.reshape(-1, 1)).view(continuation.shape)
    penalty = torch.where(flagged, _log_one_minus(chosen.exp()), 0.0)
    return -penalty.sum() / flagged.numel(), flagged.float().mean().item()
