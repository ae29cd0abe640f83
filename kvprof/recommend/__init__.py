"""`kvprof recommend`'s library: one sharing decision for a team's target over replay results of any agent families
(docs/commands/recommend.md).

- `target`: the target as a team states it (accuracy drop, KL, TTFT / TPOT at a load, KV memory, what to optimise);
- `candidates`: the replayed policy settings of every result, their accuracy and KL over tasks, the trajectory split;
- `serving`: each candidate served at a load and KV budget by `kvprof.simulate`'s engine;
- `select`: the bounds each candidate misses, the choice, the runner-up, the closest miss when none qualifies;
- `run`: the whole recommendation: choice, held-out confirmation, sensitivity, the typed result.
"""
