"""Runtime failures reach clients as typed worker errors with the right HTTP status."""

from __future__ import annotations

import pytest

from skippyd.engine.runtime.contract import (
    InvalidIterationError,
    KvSlotUnavailableError,
    LanesBusyError,
    RuntimeFailure,
)
from skippyd.engine.runtime.pipeline_types import ChainBatchError, ChainUnavailableError
from skippyd.engine.worker.worker_errors import worker_error_from_runtime


@pytest.mark.parametrize(("failure", "kind", "status", "retry"), [
    (InvalidIterationError("bad batch"), "invalid_request", 400, False),
    (LanesBusyError("all lanes busy"), "overloaded", 503, True),
    (KvSlotUnavailableError("no slot"), "overloaded", 503, True),
    (ChainUnavailableError("stage-1 is gone"), "unavailable", 503, True),
    (ChainBatchError("stage-1 failed the batch"), "backend", 500, False),
    (RuntimeFailure("llama_decode returned -3"), "backend", 500, False),
])
def test_runtime_failure_maps_to_a_typed_error(failure, kind, status, retry):
    error = worker_error_from_runtime("decode", failure)
    assert (error.kind, error.status) == (kind, status)
    assert (error.retry_after_s is not None) is retry
    assert error.message == f"decode: {failure}"
    assert error.__cause__ is failure
