"""torch.profiler on a schedule: `profiler` (the profile stage: windows, traces, the operator table); what bounds the
step is trainflow.metrics.verdict."""
