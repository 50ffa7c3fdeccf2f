"""A generation request checked against its model and tokenised: ``prepare`` turns an OpenAI body into
``Prepared`` (prompt token ids, sampling, the tools its answer is parsed against), or refuses it with a 400
naming what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_workers.protocol import Grammar, Sampling
from gpu_workers.tokenizer import ChatTemplateError
from tessera.api import tools
from tessera.api.catalog import Model
from tessera.api.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest
from tessera.api.structured import response_grammar
from tessera.errors import APIError


@dataclass
class Prepared:
    model: Model
    prompt_ids: list[int]
    sampling: Sampling
    stream: bool
    include_usage: bool
    tool_names: tuple[str, ...] = ()  # the tools the answer's calls are parsed against (none: plain text)
    n: int = 1  # choices (tessera.choices)


def prepare(body: GenerationRequest, model: Model) -> Prepared:
    """Validate ``body`` against ``model`` and tokenise it. Sync: a thread runs it, unless
    ``Gateway.prepare_for`` finds it cheap."""
    if model.embedding is not None:
        raise APIError(
            400,
            f"the model '{model.spec.name}' is an embedding model and does not generate text; send its input "
            "to POST /v1/embeddings, or pick a chat model from GET /v1/models",
            "embedding_model",
            param="model",
        )
    _check_prompt_bytes(model, body)
    tool_plan = _tool_plan(model, body)
    prompt_ids = _prompt_ids(model, body, tool_plan)
    if not prompt_ids:
        raise APIError(400, "the prompt is empty; send at least one token", "empty_prompt", param="prompt")
    context = model.context
    if len(prompt_ids) >= context:
        raise APIError(
            400,
            f"the prompt has {len(prompt_ids)} tokens but this model's context is {context} tokens, "
            "including at least one output token; shorten the prompt",
            "context_length_exceeded",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
        )
    room = context - len(prompt_ids)
    requested = body.requested_max_tokens()
    if requested is not None and requested > model.config.max_tokens_limit:
        raise APIError(
            400,
            f"max_tokens is {requested} but this model allows at most {model.config.max_tokens_limit} output tokens "
            "per request; lower max_tokens",
            "max_tokens_too_large",
            param="max_tokens",
        )
    if requested is not None and requested > room:
        raise APIError(
            400,
            f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({requested}) exceeds this model's "
            f"context of {context} tokens; set max_tokens to at most {room} or shorten the prompt",
            "context_length_exceeded",
            param="max_tokens",
        )
    sampling = Sampling(
        max_tokens=requested if requested is not None else min(model.config.max_tokens_limit, room),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stop=body.stop_list,
        ignore_eos=body.ignore_eos,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        grammar=_grammar(body, tool_plan),
        logprobs=body.logprobs_asked(),
    )
    if sampling.grammar is not None and model.tokenizer is None:
        raise APIError(
            400,
            "response_format needs a tokenizer, which this model lacks",
            "no_tokenizer",
            param="response_format",
        )
    if sampling.stop and model.tokenizer is None:
        raise APIError(
            400, "stop strings need a tokenizer, which this model lacks", "no_tokenizer", param="stop"
        )
    if sampling.logprobs is not None and model.tokenizer is None:
        raise APIError(
            400, "logprobs need a tokenizer (to write each token), which this model lacks", "no_tokenizer",
            param="logprobs",
        )  # fmt: skip
    names = tool_plan.names if tool_plan is not None else ()
    return Prepared(model, prompt_ids, sampling, bool(body.stream), body.include_usage, names, body.n or 1)


def _check_prompt_bytes(model: Model, body: GenerationRequest) -> None:
    """Refuse, before it is tokenised, a text prompt too long for the context whatever its tokens: one token
    covers at most ``bytes_per_token`` bytes, so text of more than ``(context - 1) * bytes_per_token``
    bytes is at least ``context`` tokens. Tokenising a 1 MiB prompt holds the GIL for ~1 s, stalling every
    other request of the process; this check costs a UTF-8 encode. A chat prompt counts its messages'
    text (the template's markup only adds tokens)."""
    per_token = model.bytes_per_token
    if per_token is None:
        return
    if isinstance(body, ChatCompletionRequest):
        texts = [message.text for message in body.messages]
    elif isinstance(body.prompt, str):
        texts = [body.prompt]
    else:
        return  # token ids: counted as they are, without a tokenizer
    size = sum(len(text.encode("utf-8")) for text in texts)  # valid Unicode: the schema checked it
    if size > (model.context - 1) * per_token:
        raise APIError(
            400,
            f"the prompt is {size} bytes: at least {-(-size // per_token)} tokens (a token of this model "
            f"covers at most {per_token} bytes), but this model's context is {model.context} tokens, "
            "including at least one output token; shorten the prompt",
            "context_length_exceeded",
            param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
        )


def _tool_plan(model: Model, body: GenerationRequest) -> tools.ToolPlan | None:
    if not isinstance(body, ChatCompletionRequest):
        return None
    if model.tokenizer is None or not model.tokenizer.has_chat_template:
        raise APIError(
            400,
            f"the model '{model.spec.name}' has no chat template; use /v1/completions with a prompt",
            "chat_not_supported",
            param="messages",
        )
    return tools.plan(body, model.tokenizer)


def _grammar(body: GenerationRequest, tool_plan: tools.ToolPlan | None) -> Grammar | None:
    if tool_plan is None:
        return None
    if tool_plan.grammar is not None:
        return tool_plan.grammar
    return response_grammar(body.response_format)


def _prompt_ids(model: Model, body: GenerationRequest, tool_plan: tools.ToolPlan | None) -> list[int]:
    tokenizer = model.tokenizer
    if tool_plan is not None:
        try:
            # The template writes BOS itself; message text never becomes a control token.
            return tokenizer.encode_chat(tool_plan.messages, tools=tool_plan.template_tools)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "invalid_messages", param="messages") from None
    assert isinstance(body, CompletionRequest)
    prompt = body.prompt
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError(
                400,
                f"the model '{model.spec.name}' has no tokenizer; send the prompt as a list of token ids",
                "no_tokenizer",
                param="prompt",
            )
        # As the offline engine encodes text prompts, so the same prompt gives the same tokens.
        return tokenizer.encode(prompt) if prompt else []
    bad = [t for t in prompt if not 0 <= t < model.vocab_size]
    if bad:
        raise APIError(
            400,
            f"token ids must be in [0, {model.vocab_size}); got {bad[:5]}",
            "invalid_prompt",
            param="prompt",
        )
    return list(prompt)
