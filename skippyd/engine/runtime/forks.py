"""Session forks of :class:`~skippyd.engine.runtime.llama.LlamaRuntime`: ``n > 1`` choices.

The choices of one request share its prompt: it is computed once, in one session, and
copied into each other choice's lane. Only the worker thread may call this.
"""

from __future__ import annotations

import logging

from llama_cpp import llama_cpp as L

from skippyd.engine.runtime.protocol import InvalidIterationError

logger = logging.getLogger(__name__)


class SessionForkMixin:
    """``fork_session``; mixed into ``LlamaRuntime`` (uses its memory and sessions)."""

    def fork_session(self, src_session_id: str, dst_session_id: str,
                     num_tokens: int | None = None) -> None:
        """Make ``dst`` hold ``src``'s first ``num_tokens`` tokens (all by default).

        The whole sequence is copied (``llama_memory_seq_cp`` over every position: in a
        unified cache that shares cells, across KV streams it copies the stream at the
        next decode), then ``dst`` is trimmed to ``num_tokens``.

        Raises:
            InvalidIterationError: ``src`` is unknown, holds too few tokens or is ``dst``.
            LanesBusyError: ``dst`` is new and no lane is free.
        """
        src = self._require(src_session_id)
        count = src.token_count if num_tokens is None else num_tokens
        if src_session_id == dst_session_id or not 0 < count <= src.token_count:
            raise InvalidIterationError(
                f"fork_session: cannot copy {count} tokens of {src_session_id} (holding"
                f" {src.token_count}) into {dst_session_id}")
        self.ensure_session_active(dst_session_id)
        dst = self._sessions[dst_session_id]
        L.llama_memory_seq_rm(self._mem, dst.seq_id, -1, -1)
        L.llama_memory_seq_cp(self._mem, src.seq_id, dst.seq_id, -1, -1)
        if count < src.token_count:
            L.llama_memory_seq_rm(self._mem, dst.seq_id, count, -1)
        self._set_history(dst, src.history[:count])

