"""The base model and its agents as kvprof runs them: loading (`agents`), the per-layer facts read from the model
(`layers`, `rope`, `latent`, `recurrent`), the LoRA base / adapter split (`lora`), caches that grow in place
(`buffers`) and model execution over them (`runtime`); `tiny` builds the untrained worlds the tests use."""
