"""The OpenAI-compatible HTTP API: routes, request parsing, SSE, errors and /metrics.

It reaches a stage only through the ``ServingBackend`` protocol in ``backend`` and the
worker's shared command types. Never imports llama_cpp, the runtime or the daemon.
"""
