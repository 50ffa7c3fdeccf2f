"""Admission: what makes a request servable by this engine, with errors a caller can act on, and the
sequence an admitted request becomes."""

from __future__ import annotations

import torch

from gpu_workers.engine.detokenizer import IncrementalDetokenizer
from gpu_workers.engine.grammar import Grammars
from gpu_workers.engine.params import InvalidRequest, RequestError, SamplingParams
from gpu_workers.engine.sequence import Sequence, Status
from gpu_workers.kv.transfer import KV_FORMATS, KVBlock

Prompt = str | list[int]


def check(
    prompt_ids: list[int],
    params: SamplingParams,
    context: int,
    capacity: int,
    *,
    has_tokenizer: bool,
    export_kv: str | None = None,
    kv_import_tokens: int | None = None,
) -> int:
    """Validate a request against the model's context and the KV cache; return its output-token limit.

    Raises InvalidRequest naming what is wrong and what to change.
    """
    params.validate()
    limit = max_tokens(len(prompt_ids), params, context, capacity)
    if params.stop and not has_tokenizer:
        raise InvalidRequest("no_tokenizer", "stop strings need a tokenizer; use stop_token_ids")
    if export_kv is not None and export_kv not in KV_FORMATS:
        raise InvalidRequest("invalid_kv_format", f"export_kv must be one of {sorted(KV_FORMATS)}")
    if kv_import_tokens is not None and not 0 < kv_import_tokens < len(prompt_ids):
        raise InvalidRequest(
            "invalid_kv_import",
            f"an imported KV block must cover fewer tokens than the prompt ({len(prompt_ids)}), "
            f"got {kv_import_tokens}",
        )
    return limit


def prompt_ids(prompt: Prompt, tokenizer, vocab_size: int) -> list[int]:
    """The prompt as token ids: text is encoded, ids are range-checked against the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequest(
                "no_tokenizer", "this checkpoint has no tokenizer.json; pass the prompt as token ids"
            )
        try:
            ids = tokenizer.encode(prompt) if prompt else []
        except ValueError as exc:  # text the tokenizer cannot encode, e.g. a lone surrogate
            raise InvalidRequest("invalid_prompt", str(exc)) from None
    elif isinstance(prompt, list | tuple):
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(
                "invalid_prompt", f"token ids must be integers in [0, {vocab_size}); got {bad[:5]!r}"
            )
    else:
        raise InvalidRequest(
            "invalid_prompt", f"a prompt is text or a list of token ids, not {type(prompt).__name__}"
        )
    if not ids:
        raise InvalidRequest("empty_prompt", "the prompt is empty; send at least one token")
    return ids


def max_tokens(prompt_len: int, params: SamplingParams, context: int, capacity: int) -> int:
    """How many tokens the request may generate: ``params.max_tokens``, or all the context and KV leave."""
    if prompt_len >= context:
        raise InvalidRequest(
            "context_length_exceeded",
            f"the prompt has {prompt_len} tokens but the model's context is {context} tokens, "
            "including at least one output token; shorten the prompt",
        )
    if prompt_len >= capacity:
        raise InvalidRequest(
            "kv_budget_exceeded",
            f"the prompt has {prompt_len} tokens but the whole KV cache holds {capacity}; "
            "shorten the prompt or give the engine a larger kv_budget_bytes",
        )
    limit = min(context, capacity)
    if params.max_tokens is None:
        return limit - prompt_len
    total = prompt_len + params.max_tokens
    if total > context:
        raise InvalidRequest(
            "context_length_exceeded",
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context "
            f"of {context}; set max_tokens to at most {context - prompt_len}",
        )
    if total > capacity:
        raise InvalidRequest(
            "kv_budget_exceeded",
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) exceeds the KV cache's "
            f"{capacity} tokens; set max_tokens to at most {capacity - prompt_len} or raise kv_budget_bytes",
        )
    return params.max_tokens


def prepare(
    seq: Sequence,
    prompt: Prompt,
    tokenizer,
    vocab_size: int,
    context: int,
    capacity: int,
    export_kv: str | None,
    kv_import: KVBlock | None,
    streamed_output: int,
) -> None:
    """Validate a request and fill in its sequence: prompt ids, output limit, hand-off fields, seeded
    generator and detokeniser. Raises InvalidRequest."""
    params = seq.params
    seq.prompt_ids = prompt_ids(prompt, tokenizer, vocab_size)
    seq.max_tokens = check(
        seq.prompt_ids,
        params,
        context,
        capacity,
        has_tokenizer=tokenizer is not None,
        export_kv=export_kv,
        kv_import_tokens=None if kv_import is None else kv_import.num_tokens,
    )
    if not 0 <= streamed_output < len(seq.prompt_ids):
        raise InvalidRequest(
            "invalid_streamed_output",
            f"streamed_output counts prompt ids already streamed: 0 to {len(seq.prompt_ids) - 1}, "
            f"got {streamed_output}",
        )
    seq.export_kv, seq.kv_import, seq.streamed_output = export_kv, kv_import, streamed_output
    if params.seed is not None:
        seq.generator = torch.Generator()
    if tokenizer is not None:
        context_ids = len(seq.prompt_ids) - streamed_output
        seq.detokenizer = IncrementalDetokenizer(
            tokenizer, stop=params.stop, prompt_ids=seq.prompt_ids[:context_ids]
        )
        seq.detokenizer.push(seq.prompt_ids[context_ids:])  # streamed already: only its held-back text stays


def matcher(grammars: Grammars, tokenizer, grammar, prompt: Prompt, streamed_output: int):
    """The grammar's matcher, advanced over the output an earlier phase generated (the prompt's last
    ``streamed_output`` ids): a request handed from prefill to decode continues its grammar's state."""
    if tokenizer is None:
        raise InvalidRequest(
            "grammar_needs_tokenizer", "this model has no tokenizer, so it cannot follow a grammar"
        )
    ids = prompt if isinstance(prompt, list) else []
    return grammars.matcher(grammar, ids[len(ids) - streamed_output :] if streamed_output else [])


def refuse(seq: Sequence, error: RequestError) -> None:
    """End a request that was never queued, with ``error``."""
    seq.status = Status.FINISHED
    seq.finish_reason = "error"
    seq.error = error
    seq.emit([], "")
