"""A scripted in-test backend for the OpenAI app tests.

The fake tokenizer maps each UTF-8 byte to one token (id = byte + 1; id 0 is BOS), so
multi-byte characters are split across tokens exactly as the detokenizer contract
requires. Generation runs on a background thread in lock-step with the consumer: it
sends a token, waits (bounded) for its acknowledgement, and stops on ``STOP`` or cancel.
"""

from __future__ import annotations

import codecs
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from skippyd.engine.runtime.contract import TokenLogprob
from skippyd.engine.worker.arrivals import Arrivals
from skippyd.engine.worker.generation_events import (
    AdmittedEvent,
    CompleteEvent,
    ErrorEvent,
    GenerationEvent,
    GenerationRequest,
    PromptLogprobsEvent,
    TokenAck,
    TokenControl,
    TokenEvent,
)
from skippyd.engine.worker.worker_errors import (
    QueueFullError,
    WorkerBackendError,
    WorkerStoppedError,
)

BOS = 0
WAIT_S = 10.0


def byte_tokens(text: str) -> list[int]:
    """Tokens of ``text`` in the fake vocabulary (no BOS)."""
    return [byte + 1 for byte in text.encode("utf-8")]


def fake_logprob(token: int, k: int) -> TokenLogprob:
    """A deterministic log-probability: the token itself at -0.25, alternatives after it."""
    return TokenLogprob(token, -0.25, tuple((token + i, -0.25 * (i + 1)) for i in range(k)))


class ByteDetokenizer:
    """Incremental UTF-8 detokenizer over the fake byte vocabulary."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token: int) -> str:
        if token == BOS:
            return ""
        return self._decoder.decode(bytes([token - 1]))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class RecordingAck(TokenAck):
    """A token ack that records answers and lets the fake worker wait for one."""

    def __init__(self) -> None:
        super().__init__()
        self.answered = threading.Event()
        self.num_sends = 0

    def send(self, control: TokenControl) -> bool:
        self.num_sends += 1
        accepted = super().send(control)
        self.answered.set()
        return accepted


@dataclass
class Generation:
    """What the fake saw of one submitted request."""

    request: GenerationRequest
    acks: list[RecordingAck] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    outcome: str = "running"


class FakeBackend:
    """Implements ``ServingBackend`` with a deterministic token script."""

    def __init__(self, script: str = "Hello world", *, ctx_size: int = 128) -> None:
        self.model_id = "fake-model"
        self.ctx_size = ctx_size
        self.n_vocab = 257
        self.script = byte_tokens(script)
        self.health_state: tuple[str, str | None] = ("ok", None)
        self.queue_full = False
        self.stopped = False
        self.error_after: int | None = None
        """Send an ErrorEvent after this many tokens."""
        self.hold_after: int | None = None
        """After this many tokens, wait for cancel instead of continuing."""
        self.holding = threading.Event()
        self.cached_tokens = 3
        self.generations: dict[str, Generation] = {}
        self.cancel_calls: list[str] = []
        self.rendered: list[list[dict[str, str]]] = []
        self.render_calls: list[dict] = []
        self.local_sampling = True
        self.chat_template: str | None = None
        self.refuses_tools = False
        """render_chat raises when given tool definitions, as a template without tools."""
        self._threads: list[threading.Thread] = []
        self.arrivals = Arrivals()
        self.drafts: tuple[int, int] = (0, 0)
        """(drafted, accepted) every generation reports when it completes."""
        self.preparing_at_tokenize: list[int] = []
        """``arrivals.pending`` each time a prompt was tokenized."""
        self.preparing_at_submit: list[int] = []

    @property
    def max_context_tokens(self) -> int:
        return self.ctx_size

    def describe(self) -> dict:
        return {"lane_count": 4, "layer_start": 0, "layer_end": 30, "n_layer": 30,
                "model_path": "/models/fake.gguf", "bos_token": "<s>", "eos_token": "</s>"}

    # -- ServingBackend ----------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = False) -> list[int]:
        self.preparing_at_tokenize.append(self.arrivals.pending)
        # "<s>" stands for BOS when control tokens are parsed.
        if parse_special and text.startswith("<s>"):
            return [BOS] + self.tokenize(text[3:], add_special=False, parse_special=True)
        return ([BOS] if add_special else []) + byte_tokens(text)

    def render_chat(self, messages: list[dict], *, tools=None, template_kwargs=None,
                    add_generation_prompt: bool = True) -> str:
        if any(m["role"] == "bad" for m in messages):
            raise ValueError("roles must alternate")
        if tools and self.refuses_tools:
            raise ValueError("this template takes no tools")
        self.rendered.append(messages)
        self.render_calls.append({"tools": tools, "template_kwargs": template_kwargs})
        turns = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        opening = (template_kwargs or {}).get("opening", "")
        return f"{turns}<assistant>{opening}" if add_generation_prompt else turns

    def detokenize(self, tokens: list[int]) -> str:
        return bytes(t - 1 for t in tokens if t != BOS).decode("utf-8", "replace")

    def token_bytes(self, token: int) -> bytes:
        return b"" if token == BOS else bytes([token - 1])

    def check_grammar(self, grammar: str) -> None:
        if "::=" not in grammar:
            raise ValueError("llama.cpp could not parse the grammar")

    def schema_grammar(self, schema: dict, root: str | None = None) -> str:
        if "minimum" in json.dumps(schema):
            error = ValueError("properties.age.minimum: the keyword 'minimum' is not supported")
            error.path = "properties.age.minimum"
            error.reason = "the keyword 'minimum' is not supported"
            raise error
        return f"root ::= {root or 'call'}\ncall ::= {json.dumps(json.dumps(schema))}"

    def chat_tokens(self, messages: list[dict], *, tools=None,
                    template_kwargs=None) -> tuple[list[int], str]:
        text = self.render_chat(messages, tools=tools, template_kwargs=template_kwargs)
        return self.tokenize(text, add_special=True), text

    def arriving(self):
        return self.arrivals.arriving()

    def detokenizer(self) -> ByteDetokenizer:
        return ByteDetokenizer()

    def submit(
        self, request: GenerationRequest, on_event: Callable[[GenerationEvent], None]
    ) -> None:
        self.preparing_at_submit.append(self.arrivals.pending)
        if self.queue_full:
            raise QueueFullError()
        if self.stopped:
            raise WorkerStoppedError()
        generation = Generation(request)
        self.generations[request.request_id] = generation
        thread = threading.Thread(target=self._run, args=(generation, on_event), daemon=True)
        self._threads.append(thread)
        thread.start()

    def cancel(self, request_id: str) -> None:
        self.cancel_calls.append(request_id)
        if request_id in self.generations:
            self.generations[request_id].cancelled.set()

    def health(self) -> tuple[str, str | None]:
        return self.health_state

    # -- test helpers ------------------------------------------------------------------

    def only_generation(self) -> Generation:
        assert len(self.generations) == 1, list(self.generations)
        return next(iter(self.generations.values()))

    def join(self) -> None:
        for thread in self._threads:
            thread.join(WAIT_S)
            assert not thread.is_alive(), "fake worker thread did not finish"

    def _run(self, generation: Generation, on_event: Callable[[GenerationEvent], None]) -> None:
        try:
            generation.outcome = self._drive(generation, on_event)
        finally:
            generation.done.set()

    def _drive(self, generation: Generation, on_event: Callable[[GenerationEvent], None]) -> str:
        request = generation.request
        sampling = request.sampling
        on_event(AdmittedEvent(self.cached_tokens))
        if sampling is not None and sampling.prompt_logprobs is not None:
            on_event(PromptLogprobsEvent(tuple(
                (position, fake_logprob(token, sampling.prompt_logprobs))
                for position, token in enumerate(request.prompt_tokens) if position)))
        k = None if sampling is None else sampling.logprobs
        for index, token in enumerate(self.script):
            if index == self.error_after:
                on_event(ErrorEvent(WorkerBackendError("decode failed")))
                return "error"
            if index == request.max_tokens:
                on_event(CompleteEvent("length", *self.drafts))
                return "length"
            if index == self.hold_after:
                self.holding.set()
                return "cancelled" if generation.cancelled.wait(WAIT_S) else "hold-timeout"
            ack = RecordingAck()
            generation.acks.append(ack)
            on_event(TokenEvent(token, ack, None if k is None else fake_logprob(token, k),
                                self.drafts))
            if not ack.answered.wait(WAIT_S):
                return "ack-timeout"
            if ack.poll() is TokenControl.STOP:
                on_event(CompleteEvent("stop", *self.drafts))
                return "stopped"
        on_event(CompleteEvent("stop", *self.drafts))
        return "eog"


@pytest.fixture
def fake() -> Iterator[FakeBackend]:
    """A fresh fake backend; its worker threads must all finish by teardown."""
    backend = FakeBackend()
    yield backend
    for generation in backend.generations.values():
        generation.cancelled.set()
    backend.join()
