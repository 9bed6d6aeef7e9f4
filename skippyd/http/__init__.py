"""The OpenAI-compatible HTTP API, in five rooms by concern.

* ``api``: the routes, llama-server's utility endpoints and the work a request needs
  before it is submitted; the only room that imports the others.
* ``parsing``: request bodies into typed parameters, every check naming its field.
* ``shaping``: one generation's events into text, stops, choices, logprobs and SSE.
* ``observability``: request metrics, the per-request log line, Prometheus families.
* ``guard``: connection deadlines and caps, the API key, the bounded body reader.

Beside them, the pieces every room stands on: ``backend`` (the ``ServingBackend``
protocol, the API's only way to a stage), ``event_relay`` (worker-thread events into the
event loop) and ``api_errors`` (the OpenAI error shape). Never imports llama_cpp, the
runtime or the daemon.
"""
