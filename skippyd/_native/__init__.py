"""C helpers built by ``pip install`` (an optional extension: ``setup.py``).

The sources are plain C with no Python API; :mod:`skippyd.engine.runtime.native` loads
the built library with ctypes and checks it before use.
"""
