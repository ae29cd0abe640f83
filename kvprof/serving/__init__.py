"""`kvprof serve-bench`'s parts: a trace as traffic (`traffic`), the HTTP client of an OpenAI-compatible server
(`client`), a vLLM server kvprof starts (`server`), the load driver (`driver`) and what a run measured (`summary`).

None of them imports torch, transformers or vLLM: kvprof only speaks HTTP to the serving engine.
"""
