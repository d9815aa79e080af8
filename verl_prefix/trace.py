"""Alias kept for code written before the layout change: ``from verl_prefix.trace import recording``."""

from verl_prefix.backend.trace import TraceWriter, load_trace, recording
from verl_prefix.tools.synthetic_trace import synthetic_trace

__all__ = ["TraceWriter", "load_trace", "recording", "synthetic_trace"]
