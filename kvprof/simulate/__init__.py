"""`kvprof simulate`'s library: each policy's replayed per-turn work served by a modelled continuous-batching engine
under a load, without a GPU or an engine implementing the policy (docs/commands/simulate.md).

- `workload`: replay records as requests, at a prefix-cache block granularity, optionally scaled linearly;
- `cost`: the step-time model, fitted to serve-bench or replay timings, or an uncalibrated roofline;
- `engine`: a vLLM-V1-style scheduler driven by Poisson or closed-loop arrivals;
- `sweep`: each policy at each load (percentiles, throughput, memory, OOM, SLO load) and the calibration's errors.

Serving-claim verdicts: `kvprof.claims.serving`. Pure Python (numpy and scipy for the fit only).
"""

DEFAULT_QPS = (0.5, 1.0, 2.0, 4.0, 8.0)  # the loads `kvprof simulate` sweeps by default (trajectories per second)
