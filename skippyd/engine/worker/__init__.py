"""The iteration worker: one thread per stage, the only code that calls its runtime.

``handle`` is the callers' side (it reaches the worker only through its bounded command
queue); ``command_loop`` is the thread every worker shares; ``generations`` (stage 0)
and ``batches`` (a later stage) are the two roles a turn of that loop runs; ``record``
is the one record a generation has on the worker thread. The rest are shared types and
helpers.
"""
