"""Tokenization, incremental detokenization and chat templates from a GGUF's vocabulary.

The tokenizer loads its own vocabulary-only copy of the model, separate from the
runtime's context, so HTTP handlers can tokenize on their own threads without ever
touching the objects the worker thread owns.
"""

from __future__ import annotations

import codecs
import ctypes
import os
import secrets
import threading
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.constrained import check_grammar
from skippyd.engine.runtime.llama_ext import ensure_backend


class TokenizerError(ValueError):
    """Text could not be tokenized or a chat could not be rendered."""


class TemplateRewritesContent(TokenizerError):
    """The chat template does not copy message content through unchanged and once."""


class Tokenizer:
    """Thread-safe tokenizer over a vocabulary-only load of a GGUF model."""

    def __init__(self, model_path: str | os.PathLike, *, chat_template: str | None = None) -> None:
        """Load the vocabulary; ``chat_template`` replaces the model's own template.

        Raises:
            TokenizerError: The vocabulary cannot be loaded or the template compiled.
        """
        ensure_backend()
        params = L.llama_model_default_params()
        params.vocab_only = True
        self._model = L.llama_model_load_from_file(os.fsencode(str(model_path)), params)
        if not self._model:
            raise TokenizerError(f"could not load the vocabulary of {model_path}")
        self._vocab = L.llama_model_get_vocab(self._model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self._vocab))
        self.bos_token_id = int(L.llama_vocab_bos(self._vocab))
        self.eos_token_id = int(L.llama_vocab_eos(self._vocab))
        self.add_bos = bool(L.llama_vocab_get_add_bos(self._vocab))
        self._pieces: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self.chat_template = chat_template or self._metadata("tokenizer.chat_template")
        try:
            self._template = _compile_template(self.chat_template) if self.chat_template else None
        except jinja2.TemplateSyntaxError as exc:
            self.close()
            raise TokenizerError(f"the chat template does not compile: {exc}") from exc
        self._control_texts: frozenset[str] | None = None

    def close(self) -> None:
        if self._model:
            L.llama_model_free(self._model)
            self._model = None

    def _metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = L.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            L.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids for ``text``; ``add_special`` adds BOS when the model wants it."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (L.llama_token * capacity)()
        n = L.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (L.llama_token * capacity)()
            n = L.llama_tokenize(
                self._vocab, data, len(data), buf, capacity, add_special, parse_special
            )
        if n < 0:
            raise TokenizerError("text could not be tokenized")
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token renders to (special/control tokens render as nothing)."""
        piece = self._pieces.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(256)
            n = L.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = L.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            piece = buf.raw[: max(n, 0)]
            with self._lock:
                self._pieces[token] = piece
        return piece

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)

    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self._vocab, token))

    def check_grammar(self, text: str) -> None:
        """Parse a GBNF grammar against this vocabulary (thread-safe: a private sampler).

        Raises:
            GrammarError: llama.cpp cannot parse it.
        """
        check_grammar(self._vocab, text)

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> str:
        """Render messages with the chat template (Jinja, sandboxed).

        Args:
            messages: The conversation.
            add_generation_prompt: Open the assistant's turn at the end.
            tools: Tool definitions for templates that render them (``tools`` variable).
            template_kwargs: Extra template variables (``enable_thinking``…).

        Raises:
            TokenizerError: No template, or the template failed (a message it refuses).
        """
        if self._template is None:
            raise TokenizerError("the model has no chat template; use /v1/completions")
        try:
            return self._template.render(
                **(template_kwargs or {}),
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.detokenize([self.bos_token_id]) if self.bos_token_id >= 0 else "",
                eos_token=self.detokenize([self.eos_token_id]) if self.eos_token_id >= 0 else "",
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            # A template indexing into a message it does not expect raises plain Python
            # errors: they are the messages' fault as much as a raise_exception is.
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def render_chat_pieces(self, messages: list[dict], *, add_generation_prompt: bool = True,
                           tools: list[dict] | None = None,
                           template_kwargs: dict | None = None) -> list[tuple[str, bool]]:
        """The rendered chat as ``(text, is_markup)`` pieces: the template's own text
        apart from each message's content, so content can be tokenized as plain text.

        Each content is swapped for a unique marker before rendering and put back
        between the pieces of markup around its marker.

        Raises:
            TokenizerError: The template has none, failed, or did not pass every marker
                through unchanged exactly once (it rewrites or repeats message text).
        """
        nonce = secrets.token_hex(8)
        marked: list[dict[str, Any]] = []
        contents: list[str] = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str) and content:
                marked.append({**message, "content": f"\ue000{nonce}.{len(contents)}\ue001"})
                contents.append(content)
            else:
                marked.append(message)
        text = self.render_chat(marked, add_generation_prompt=add_generation_prompt,
                                tools=tools, template_kwargs=template_kwargs)
        pieces: list[tuple[str, bool]] = []
        cursor = 0
        for index, content in enumerate(contents):
            marker = f"\ue000{nonce}.{index}\ue001"
            at = text.find(marker, cursor)
            if at < 0 or text.count(marker) != 1:
                raise TemplateRewritesContent("the chat template rewrites or repeats "
                                              "message content")
            pieces += [(text[cursor:at], True), (content, False)]
            cursor = at + len(marker)
        pieces.append((text[cursor:], True))
        return [piece for piece in pieces if piece[0]]

    def tokenize_pieces(self, pieces: list[tuple[str, bool]], *, add_special: bool) -> list[int]:
        """Tokenize rendered pieces: markup with special tokens parsed, content without."""
        tokens: list[int] = []
        for index, (text, is_markup) in enumerate(pieces):
            tokens += self.tokenize(text, add_special=add_special and index == 0,
                                    parse_special=is_markup)
        return tokens

    def control_token_texts(self) -> frozenset[str]:
        """The text of every control or user-defined token (what parse_special matches)."""
        if self._control_texts is None:
            special = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED
            texts = set()
            for token in range(self.n_vocab):
                if int(L.llama_vocab_get_attr(self._vocab, token)) & special:
                    text = self._special_text(token)
                    if text:
                        texts.add(text)
            self._control_texts = frozenset(texts)
        return self._control_texts

    def _special_text(self, token: int) -> str:
        buf = ctypes.create_string_buffer(256)
        n = L.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, True)
        return buf.raw[: max(n, 0)].decode("utf-8", "replace")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a token stream into text without splitting a UTF-8 character.

    :meth:`feed` returns the text that became complete with this token; bytes of a
    character split across tokens are held until the character is whole.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token: int) -> str:
        return self._decoder.decode(self._tokenizer.token_bytes(token))

    def flush(self) -> str:
        """Whatever is still held, with an incomplete character replaced by U+FFFD."""
        return self._decoder.decode(b"", final=True)
