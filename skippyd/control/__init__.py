"""The local control socket: its server, wire format (docs/control-protocol.md) and clients.

``skippyd status``, ``skippyd top`` and scripts use the clients. It reads snapshots and
telemetry only: never imports llama_cpp, nor anything of the engine but the telemetry hub.
"""
