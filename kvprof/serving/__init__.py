"""`kvprof serve-bench`'s parts: `traffic`, `client` (OpenAI-compatible HTTP), `server` (a vLLM kvprof starts),
`driver` (the load) and `summary`. None imports torch, transformers or vLLM: kvprof only speaks HTTP.
"""
