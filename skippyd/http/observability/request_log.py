"""One ``info`` line per finished request: where its time went, and what the cache saved.

The line is built from what the request's :class:`~skippyd.http.observability.request_timer.RequestTimer`
already measured on the event loop (submit, admission, first and last token, the
prompt tokens its admission restored from the prefix cache): no work is added on the
worker thread. With ``telemetry.log_format = "json"`` the same values come as
structured fields. A request that ended before it was admitted logs ``-`` as its
queue time.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skippyd.http.observability.request_timer import RequestTimer

logger = logging.getLogger(__name__)

#: HTTP status logged for a request whose client went away (nginx's convention).
CLIENT_CLOSED = 499


def request_fields(timer: RequestTimer) -> dict[str, Any]:
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
        "cached_tokens": timer.num_cached_tokens, "generated_tokens": timer.num_generated_tokens,
        "queue_ms": ms(timer.submitted_at, timer.admitted_at),
        "ttft_ms": ms(timer.submitted_at, timer.first_token_at),
        "decode_tok_s": decode_tok_s, "total_ms": ms(timer.submitted_at, timer.ended_at),
        "drafted_tokens": timer.num_drafted, "accepted_tokens": timer.num_draft_accepted,
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
            f" total {show(fields['total_ms'], 'ms')}"
            + (f", drafts {fields['accepted_tokens']}/{fields['drafted_tokens']} accepted"
               if fields.get("drafted_tokens") else ""))


class RequestLog:
    """Writes the line of each ended request.

    Args:
        enabled: ``telemetry.log_requests``; when False nothing is logged.
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled

    def ended(self, timer: RequestTimer) -> None:
        """The request ended: log its line."""
        if not self.enabled or not logger.isEnabledFor(logging.INFO):
            return
        fields = request_fields(timer)
        logger.info("%s", format_request_line(fields), extra={"fields": fields})
