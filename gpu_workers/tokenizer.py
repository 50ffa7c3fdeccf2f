"""A checkpoint's tokenizer (``tokenizer.json``) and chat template, without torch or transformers.

The gateway uses this to count and encode prompts, so it must stay importable without torch.
"""

from __future__ import annotations

import contextlib
import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gpu_workers.checkpoint import ModelLoadError, read_json, token_id_list
from gpu_workers.gguf_file import GGUFError, is_gguf, open_gguf


class ChatTemplateError(ValueError):
    """The checkpoint has no chat template, or its template rejected the messages."""


class UnencodableText(ValueError):
    """Text with a lone UTF-16 surrogate: not valid Unicode, so no tokenizer can encode it."""


def check_text(text: str) -> str:
    """``text`` unchanged, or UnencodableText saying where it is not valid Unicode.

    JSON's ``\\ud800`` escapes decode to lone surrogates that Python strings hold but UTF-8 (and so the
    Rust tokenizer) cannot represent; found here, they are the caller's error rather than a crash.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnencodableText(
            f"the text has a lone UTF-16 surrogate (U+{ord(text[e.start]):04X}) at character {e.start}, "
            "which is not valid Unicode; send valid UTF-8 text (surrogates only as pairs)"
        ) from None
    return text


class Tokenizer:
    """Encode, decode and render chat prompts the way Hugging Face's tokenizer for this checkpoint does."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: list[int] | None = None,
    ):
        self._tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        eos = [tokenizer.token_to_id(eos_token)] if eos_token else []
        self.eos_token_ids = [i for i in dict.fromkeys(eos + (extra_eos_token_ids or [])) if i is not None]
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.chat_template = chat_template

    @cached_property
    def _template(self) -> jinja2.Template:
        # Compiled on first use, so a broken template fails chat requests rather than loading the model.
        return _environment().from_string(self.chat_template)

    def warm(self) -> None:
        """Build now what chat requests would build on first use (the compiled template, the special tokens'
        texts, the copy that reads them as plain text), so that no request pays for it where it runs; a
        template that does not compile still fails only chat requests."""
        if self.chat_template is None:
            return
        _ = self._special_texts, self._literal
        with contextlib.suppress(jinja2.TemplateError):
            _ = self._template

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The ``tokenizers`` object itself, for its Rust-side helpers (incremental decoding)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with special tokens, BOS is added once (by the post-processor or here).

        Raises UnencodableText for text that is not valid Unicode."""
        ids = self._tokenizer.encode(check_text(text), add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may hold part of a character; a control
        token is its own text), b"" for an id outside the vocabulary."""
        token = self._tokenizer.id_to_token(token_id)
        if token is None:
            return b""
        chars = self._byte_of_char
        if chars is not None and all(c in chars for c in token):
            return bytes(chars[c] for c in token)
        if chars is not None:  # an added token outside the byte alphabet: its text as written
            return token.encode()
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()

    @cached_property
    def _byte_of_char(self) -> dict[str, int] | None:
        """Byte-level BPE's alphabet, character to byte (GPT-2's table); None for other tokenizers."""
        decoder = json.loads(self._tokenizer.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
        if "ByteLevel" not in kinds:
            return None
        printable = [
            *range(ord("!"), ord("~") + 1),
            *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1),
        ]
        others = [b for b in range(256) if b not in printable]
        table = {chr(b): b for b in printable}
        table.update({chr(256 + i): b for i, b in enumerate(others)})
        return table

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` (and ``tools``, OpenAI's tool objects, as transformers passes
        them); it already holds any BOS the template writes, so encode it with ``add_special_tokens=False``
        to avoid a second one."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "this checkpoint has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); send a plain completion request instead"
            )
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from e

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template writes the ``tools`` it is given into the prompt."""
        if self.chat_template is None:
            return False
        probe = [{"role": "user", "content": "x"}]
        tool = {"type": "function", "function": {"name": "probe_tool", "description": "", "parameters": {}}}
        try:
            return self.apply_chat_template(probe, tools=[tool]) != self.apply_chat_template(probe)
        except ChatTemplateError:
            return False

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the chat prompt for ``messages``, where a message's text never becomes a control token.

        Encoding the rendered prompt as one string (as Hugging Face does) turns a user's literal ``<s>`` or
        ``<|im_start|>`` into the special token itself, letting message text forge the template's markup.
        Prompts whose messages hold no special token's text encode exactly that way; otherwise the messages'
        text is encoded apart from the template's, with special tokens matched as plain text. A template that
        rewrites the text it is given (so the two cannot be told apart) makes such a message a
        ChatTemplateError instead."""
        text = check_text(self.apply_chat_template(messages, add_generation_prompt, tools))
        contents = [m.get("content") for m in messages]
        forged = sorted({s for c in contents if isinstance(c, str) for s in self._special_texts if s in c})
        if not forged:
            return self.encode(text, add_special_tokens=False)
        marked = [
            {**m, "content": f"{_MARK_OPEN}{i}{_MARK_CLOSE}"} if isinstance(m.get("content"), str) else m
            for i, m in enumerate(messages)
        ]
        pieces = _MARKS.split(self.apply_chat_template(marked, add_generation_prompt, tools))
        markup, indices = pieces[0::2], [int(i) for i in pieces[1::2]]
        rebuilt = markup[0] + "".join(
            contents[i] + after for i, after in zip(indices, markup[1:], strict=True)
        )
        if rebuilt != text:
            raise ChatTemplateError(
                f"a message contains {', '.join(map(repr, forged))}, the text of this model's control "
                "token(s), and its chat template rewrites message text, so it cannot be kept apart from the "
                "template's own markup; remove or escape it"
            )
        ids = self._tokenizer.encode(markup[0], add_special_tokens=False).ids
        for i, after in zip(indices, markup[1:], strict=True):
            ids += self._literal.encode(contents[i], add_special_tokens=False).ids
            ids += self._tokenizer.encode(after, add_special_tokens=False).ids
        return ids

    @cached_property
    def _special_texts(self) -> frozenset[str]:
        return frozenset(t.content for t in self._tokenizer.get_added_tokens_decoder().values() if t.special)

    @cached_property
    def _literal(self) -> tokenizers.Tokenizer:
        """A copy of the tokenizer that reads special tokens' text as plain text."""
        literal = tokenizers.Tokenizer.from_str(self._tokenizer.to_str())
        literal.encode_special_tokens = True
        return literal


# Stand-ins for message text while locating it in a rendered template (Unicode private-use characters).
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARKS = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder, or None when it has no ``tokenizer.json``; a GGUF file's, built
    from its metadata."""
    path = Path(path)
    if is_gguf(path):
        return gguf_tokenizer(path)
    if not (path / "tokenizer.json").is_file():
        return None
    config = _optional_json(path / "tokenizer_config.json")
    generation = _optional_json(path / "generation_config.json")
    return Tokenizer(
        tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")),
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        add_bos_token=bool(config.get("add_bos_token", False)),
        chat_template=_chat_template(path, config),
        extra_eos_token_ids=token_id_list(generation.get("eos_token_id")),
    )


# llama.cpp's pre-tokenizers (``tokenizer.ggml.pre``) for byte-level BPE vocabularies: the splits its
# llama-vocab.cpp applies before BPE, as ``tokenizers`` pre-tokenizers (a Split with the same regex, or the
# same rules by name). Anything else is refused rather than tokenised differently from llama.cpp.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),  # digits one by one, then GPT-2's rules
    "llama3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
}
_CONTROL, _USER_DEFINED = 3, 4  # GGML token types


def gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The byte-level BPE tokenizer a GGUF file describes (``tokenizer.ggml.*``): vocabulary, merges,
    llama.cpp's pre-tokenizer, control tokens as special tokens, BOS/EOS and the chat template.

    Raises ModelLoadError for a tokenizer model or pre-tokenizer llama.cpp would split differently."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

    try:
        gguf = open_gguf(path)
        kind = gguf.get("tokenizer.ggml.model")
        pre = gguf.get("tokenizer.ggml.pre") or "default"
        tokens, types, merges = gguf.vocabulary()
    except GGUFError as e:
        raise ModelLoadError(str(e)) from None
    name = Path(path).name
    if kind != "gpt2":
        raise ModelLoadError(
            f"{name} has a {kind!r} tokenizer; GGUF files load with byte-level BPE ('gpt2', as Llama 3, "
            "Qwen and SmolLM use) only"
        )
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{name} names pre-tokenizer {pre!r}; supported: {', '.join(GGUF_PRE_TOKENIZERS)} (another one "
            "would split text differently from llama.cpp)"
        )
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre in ("llama3", "llama-bpe")))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in GGUF_PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _USER_DEFINED
        ]
    )

    def text(key: str) -> str | None:
        token_id = gguf.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    eot = gguf.get("tokenizer.ggml.eot_token_id")
    return Tokenizer(
        backend,
        bos_token=text("bos_token_id"),
        eos_token=text("eos_token_id"),
        add_bos_token=bool(gguf.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=gguf.get("tokenizer.chat_template"),
        extra_eos_token_ids=[] if eot is None else [int(eot)],
    )


def _optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def _token_text(token: str | dict[str, Any] | None) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as serialised AddedToken dicts.
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    # Newer checkpoints ship the template as its own file; older ones keep it in tokenizer_config.json,
    # sometimes as a list of named templates of which "default" is the chat one.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    # Jinja's own tojson HTML-escapes '<', '>' and '&', which would change tool schemas inside prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    # The same sandboxed environment and helpers transformers gives templates, so they render identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def train_byte_level_bpe(
    texts: list[str], vocab_size: int, special_tokens: list[str]
) -> tokenizers.Tokenizer:
    """A byte-level BPE (GPT-2 pre-tokenisation, so any text encodes) trained on ``texts``.

    ``special_tokens[0]`` is BOS (id 0); encoding prepends it, like Llama's tokenizer, while chat templates
    write it themselves.
    """
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    bos = special_tokens[0]
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=special_tokens,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer
