"""torch.profiler on a schedule: `profiler` (the profile stage: windows, traces, the operator table) and `verdict`
(what bounds the step, in shares of its time, and the action to take)."""
