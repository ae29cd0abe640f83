"""`kvprof simulate`'s library: every sharing policy's measured per-turn work served by a modelled continuous-batching
engine under a load, without a GPU or a serving engine that implements the policy.

- `workload`: a replay's per-turn records as requests (tokens to prefill and their FLOPs, decode steps, bytes kept
  between turns), at an engine's prefix-cache block granularity, optionally scaled linearly to the papers' sizes;
- `cost`: the step-time model t_step = a + b·prefill + c·decode_seqs + d·kv_read + f·adapter_tokens +
  g·[any adapter] (+ a per-request overhead e on TTFT), fitted to serve-bench or replay timings, or an uncalibrated
  roofline from a device's peak figures;
- `engine`: an iteration-level model of a vLLM-V1-style scheduler (token budget, chunked prefill, max_num_seqs,
  KV blocks from a memory budget, preemption by recompute) driven by Poisson or closed-loop trajectory arrivals;
- `sweep`: each policy at each load, its latency percentiles, throughput, memory, out-of-memory verdicts and the
  highest load meeting a TTFT SLO; and the calibration's errors on its own runs.

The published serving figures' verdicts from a simulation are `kvprof.claims.serving`.

Pure Python (no torch; numpy and scipy only for the fit): an hour of traffic at 8 qps for each of 17 policies takes
40–50 s on one core (scripts/simulate_bench.py).
"""

DEFAULT_QPS = (0.5, 1.0, 2.0, 4.0, 8.0)  # the loads `kvprof simulate` sweeps by default (trajectories per second)
