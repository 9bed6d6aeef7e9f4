"""One ``info`` line per finished request, as llama-server prints one per task.

The line is built from what the request's :class:`~skippyd.http.metrics.RequestTimer`
already measured on the event loop (submit, admission, first and last token), plus the
prefix cache's count of restored prompt tokens: no work is added on the worker thread.
With ``telemetry.log_format = "json"`` the same values come as structured fields.

A generation may finish before the worker event that shows its admission reaches the
event loop (it comes right after); its line then waits for that event, so the queue
time is always known when the line is written, or ``-`` if it never comes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skippyd.http.request_timer import RequestTimer

logger = logging.getLogger(__name__)

#: HTTP status logged for a request whose client went away (nginx's convention).
CLIENT_CLOSED = 499


def request_fields(timer: RequestTimer, cached_tokens: int) -> dict[str, Any]:
    """The logged values of one ended request (times in ms, None when unknown)."""
    def ms(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else round((end - start) * 1000.0, 1)

    decode_tok_s = None
    if timer.num_generated_tokens >= 2 and timer.first_token_at is not None \
            and timer.last_token_at is not None and timer.last_token_at > timer.first_token_at:
        decode_tok_s = round((timer.num_generated_tokens - 1)
                             / (timer.last_token_at - timer.first_token_at), 2)
    return {
        "request_id": timer.request_id, "status": timer.status,
        "finish_reason": timer.outcome, "prompt_tokens": timer.num_prompt_tokens,
        "cached_tokens": cached_tokens, "generated_tokens": timer.num_generated_tokens,
        "queue_ms": ms(timer.submitted_at, timer.admitted_at),
        "ttft_ms": ms(timer.submitted_at, timer.first_token_at),
        "decode_tok_s": decode_tok_s, "total_ms": ms(timer.submitted_at, timer.ended_at),
    }


def format_request_line(fields: dict[str, Any]) -> str:
    """``request ID: 200 stop, prompt 57 tok (cached 32), generated 64 tok, …``."""
    def show(value: Any, unit: str) -> str:
        return "-" if value is None else f"{value:g} {unit}"

    return (f"request {fields['request_id']}: {fields['status']} {fields['finish_reason']},"
            f" prompt {fields['prompt_tokens']} tok (cached {fields['cached_tokens']}),"
            f" generated {fields['generated_tokens']} tok,"
            f" queue {show(fields['queue_ms'], 'ms')}, ttft {show(fields['ttft_ms'], 'ms')},"
            f" decode {show(fields['decode_tok_s'], 'tok/s')},"
            f" total {show(fields['total_ms'], 'ms')}")


class RequestLog:
    """Writes the line of each ended request, once its queue time is known.

    Args:
        cached_tokens: Prompt tokens of a request restored from the prefix cache.
        enabled: ``telemetry.log_requests``; when False nothing is logged.
    """

    def __init__(self, cached_tokens: Callable[[str], int] | None = None, *,
                 enabled: bool = True) -> None:
        self.enabled = enabled
        self._cached_tokens = cached_tokens or (lambda _req_id: 0)
        self._pending: dict[str, RequestTimer] = {}

    def ended(self, timer: RequestTimer, awaiting_admission: bool) -> None:
        """The request ended; log it now, or once its admission is seen."""
        if not self.enabled:
            return
        if awaiting_admission:
            self._pending[timer.request_id] = timer
        else:
            self.write(timer)

    def admitted(self, timer: RequestTimer) -> None:
        """The admission of an ended request was just seen: its line can go out."""
        if self._pending.pop(timer.request_id, None) is not None:
            self.write(timer)

    def flush(self) -> None:
        """Write every line still waiting (the metrics stop following the worker)."""
        pending, self._pending = self._pending, {}
        for timer in pending.values():
            self.write(timer)

    def write(self, timer: RequestTimer) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        fields = request_fields(timer, self._cached_tokens(timer.request_id))
        logger.info("%s", format_request_line(fields), extra={"fields": fields})
