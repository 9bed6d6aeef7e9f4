"""The iteration worker: one thread per stage that runs the policy's plans on a runtime.

Its thread is the only code that calls a llama.cpp context at run time. ``thread_*``
modules run on the worker thread only; ``handle`` and ``caller`` run on callers' threads
and reach the worker only through its bounded command queue; the rest are shared types.
"""
