"""Command result files as typed objects: per command one writer (`to_json`) and one reader (`read`, refusing a
foreign or newer file in one sentence). No torch, so `kvprof report` runs without it."""
