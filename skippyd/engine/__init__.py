"""The engine: the scheduling policy, the prefix cache, the runtimes and the worker.

``policy`` decides each iteration, the ``worker`` thread runs it on a ``runtime`` and
``prefix_cache`` remembers what was computed. Nothing here imports the HTTP API, the
link, the control socket, the daemon, the TUI or the CLI.
"""
