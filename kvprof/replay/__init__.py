"""Replaying a trace under sharing policies: the engine and its result (`engine`), how turns follow the shared
context (`branches`), the metric definitions (`metrics`), each policy's exact setting checked on the user's model
(`self_check`) and sharded replay on a Ray cluster (`sharded`)."""
