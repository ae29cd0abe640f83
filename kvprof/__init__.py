"""kvprof: a profiler for KV-cache sharing in multi-agent LLM systems."""

__version__ = "0.1.0"
