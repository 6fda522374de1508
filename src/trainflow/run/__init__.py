"""One run put together and started: `assembly` (train: assemble the run, the loop, the summary) and `launch`
(trainflow's own elastic agent: the ranks on this machine, when no launcher started them)."""
