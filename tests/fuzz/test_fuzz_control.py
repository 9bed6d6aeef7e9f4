"""Fuzz the control-socket protocol: the parser and a live server.

``parse_request`` may only raise ``ProtocolError`` with a documented code; a real
``ControlServer`` answers every random or mutated line with an error line and keeps
serving ``status`` on the same connection.
"""

from __future__ import annotations

import asyncio
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippyd.control.protocol import ERROR_CODES, ProtocolError, parse_request
from skippyd.control.server import ControlServer
from skippyd.engine.worker.telemetry import TelemetryHub

FUZZ = settings(max_examples=400, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
requests = st.fixed_dictionaries(
    {}, optional={"v": json_values | st.just(1), "id": json_values,
                  "op": st.sampled_from(["status", "subscribe", "events", "unsubscribe"]) | json_values,
                  "interval_ms": json_values | st.integers(0, 100_000), "events": json_values,
                  "filter": json_values | st.lists(st.text(max_size=8), max_size=40)})


@FUZZ
@given(st.binary(max_size=300) | requests.map(lambda r: json.dumps(r).encode()))
def test_parser_raises_only_protocol_errors(line):
    try:
        parse_request(line)
    except ProtocolError as exc:
        assert exc.code in ERROR_CODES and exc.message


@FUZZ
@given(st.lists(st.binary(max_size=200).filter(lambda b: b"\n" not in b)
                | requests.map(lambda r: json.dumps(r).encode()), min_size=1, max_size=8))
def test_server_survives_random_lines(tmp_path, lines):
    asyncio.run(_exchange(tmp_path / "c.sock", lines))


async def _exchange(path, lines) -> None:
    server = ControlServer(path, stage_id="fuzz", snapshot=lambda: {"stage": {"id": "fuzz"}},
                           telemetry=TelemetryHub())
    await server.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 20)
        hello = json.loads(await asyncio.wait_for(reader.readline(), 5))
        assert hello["type"] == "hello"
        for line in lines:
            writer.write(line + b"\n")
        writer.write(b'{"v":1,"id":"final","op":"status"}\n')
        await writer.drain()
        while True:  # every reply parses; the final status still comes back
            reply = json.loads(await asyncio.wait_for(reader.readline(), 5))
            assert reply["v"] == 1
            if reply.get("id") == "final" and reply["type"] == "snapshot":
                break
        writer.close()
    finally:
        await server.close()
