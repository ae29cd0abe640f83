"""The base model and its agents as kvprof runs them: a decoder's structure (`architecture`: layers, attention or
recurrent mixer, head sizes), the per-layer facts read from the model (`layers`, `rope`, `latent`, `recurrent`), the
LoRA base / adapter split (`lora`), loading (`agents`) and its checks of the files a user brings (`checks`), caches
that grow in place (`buffers`) and model execution over them (`runtime`); `tiny` builds the untrained worlds the
tests use. Modules import each other without a cycle, `architecture` at the bottom (tests/test_layering.py)."""
