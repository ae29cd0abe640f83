"""Replaying a trace under sharing policies: `engine`, `branches` (following the shared context), `metrics`,
`self_check` (exact settings on the user's model), `sharded` (Ray)."""
