"""What a sampled token does to its request: the grammar's verdict, stop tokens and strings, the length
limit; the text the token releases."""

from __future__ import annotations

from gpu_workers.engine.params import RequestError
from gpu_workers.engine.sequence import Sequence


def append_token(
    seq: Sequence, token: int, eos_token_ids: frozenset[int]
) -> tuple[str, str | None, RequestError | None]:
    """Append ``token`` to a request's output. Returns the text it releases, why the request ends ("stop",
    "length", "error"; None while it goes on) and the error it ends with, if any."""
    seq.output_ids.append(token)
    text = ""
    reason = None
    grammar_done = False
    if seq.matcher is not None:
        if not seq.matcher.consume_token(token):
            return (
                "",
                "error",
                RequestError("grammar_failed", f"the output left its grammar: {seq.matcher.get_error()}"),
            )
        # A grammar that is complete allows nothing but end-of-sequence: the request stops there.
        grammar_done = seq.matcher.is_stopped()
    if token in seq.params.stop_token_ids or (not seq.params.ignore_eos and token in eos_token_ids):
        reason = "stop"
    elif seq.detokenizer is not None:
        text = seq.detokenizer.push([token])
        if seq.detokenizer.stopped:
            reason = "stop"
    if reason is None and grammar_done:
        reason = "stop"
    if reason is None and len(seq.output_ids) >= seq.max_tokens:
        reason = "length"
    # An exporting request that reached max_tokens continues elsewhere (Engine.add_request): what the
    # detokeniser holds back is the continuation's to release.
    continues = reason == "length" and seq.export_kv is not None
    if reason is not None and seq.detokenizer is not None and not seq.detokenizer.stopped and not continues:
        text += seq.detokenizer.finish()
    return text, reason, None
