"""Runtimes: what the worker drives, over one llama.cpp context or a split pipeline.

``protocol`` is the contract (plain dataclasses, no llama.cpp); ``llama``, ``lanes``, ``host_state``,
``sampling`` and ``llama_ext`` wrap a context; ``pipeline`` runs stage 0 of a split
pipeline; ``tokenizer`` has its own vocabulary-only copy for callers' threads. A runtime
is called from the worker thread only, and nothing here imports http, link or daemon.
"""
