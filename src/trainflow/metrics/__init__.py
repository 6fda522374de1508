"""Figures computed from what a run measured: `flops` (FLOPs and peak: MFU), `batch_fit` (batch sizes refused
before anything of their size is allocated), `activations` (what autograd keeps for backward, block by block),
`noise` (intervals, bands, verdicts), `verdict` (what bounds the step, from the profiler's events) and `regions`
(the names of a step's parts that the profiler records)."""
