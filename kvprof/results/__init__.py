"""The result files of kvprof's commands as typed objects: one module per command, each with one writer (`to_json`)
and one reader (`read`, refusing a foreign or newer file in one sentence). No torch: `kvprof report` renders any
result on a machine without it."""
