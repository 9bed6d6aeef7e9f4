"""skippyd: a llama.cpp stage daemon with an iteration scheduler."""

__version__ = "0.1.0"
