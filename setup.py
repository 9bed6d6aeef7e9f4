"""The optional native helpers (``skippyd/_native``): built with the C compiler that
installing llama-cpp-python needs anyway; without one, the install goes on and the
daemon takes its Python paths (``skippyd status`` says which)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "skippyd._native.helpers",
    sources=["skippyd/_native/capture.c", "skippyd/_native/wake.c"],
    extra_compile_args=["-O2"],
    optional=True,
)])
