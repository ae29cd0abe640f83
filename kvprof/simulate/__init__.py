"""`kvprof simulate`'s library: every sharing policy's measured per-turn work served by a modelled continuous-batching
engine under a load, without a GPU or a serving engine that implements the policy.

- `workload`: a replay's per-turn records as requests (tokens to prefill and their FLOPs, decode steps, bytes kept
  between turns), optionally scaled linearly to the papers' sizes;
- `cost`: the step-time model t_step = a + b·prefill + c·decode_seqs + d·kv_read (+ a per-request overhead e on
  TTFT), fitted to serve-bench or replay timings, or an uncalibrated roofline from a device's peak figures;
- `engine`: an iteration-level model of a vLLM-V1-style scheduler (token budget, chunked prefill, max_num_seqs,
  KV blocks from a memory budget, preemption by recompute) driven by Poisson or closed-loop trajectory arrivals;
- `sweep`: each policy at each load, its latency percentiles, throughput, memory, out-of-memory verdicts and the
  highest load meeting a TTFT SLO; and the calibration's errors on its own runs.

Pure Python (no torch, numpy only for the fit), so that a sweep of every policy over an hour of traffic runs in
seconds on one core.
"""
