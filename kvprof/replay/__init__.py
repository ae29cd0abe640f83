"""Replaying a trace under sharing policies: `engine` (`run_replay`), `lockstep` (the teacher-forced loop), `records`
(one turn against the dense turn), `memory`, `summary`, `timing`, `online` (re-runs), `setting` (how a replay runs and
ran), `parking` (stored caches held within a KV budget), `branches` (following the shared context), `metrics`,
`self_check` (exact settings on the user's model), `shards` (sharded replay planned and merged), `ray_cluster` and
`ray_worker` (its Ray backend: driver and actors)."""
