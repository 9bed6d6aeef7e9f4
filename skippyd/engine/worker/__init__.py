"""The iteration worker: one thread per stage that runs the policy's plans on the runtime.

The only code that calls llama.cpp at run time. ``thread_*`` modules run on the worker
thread only; ``handle`` and ``caller`` run on caller threads and reach the worker only
through its bounded command queue; the other modules hold types both sides share.
"""
