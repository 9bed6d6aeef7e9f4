"""The stage-to-stage TCP link of a split pipeline (protocol in docs/stage-protocol.md).

``wire`` is the frame codec, ``framing`` frames on sockets, ``handshake`` the mutual
authentication, ``dialer`` stage 0's side, ``listener`` and ``relay`` a later stage's.
Never imports llama_cpp: a later stage reaches its runtime only through the worker.
"""
