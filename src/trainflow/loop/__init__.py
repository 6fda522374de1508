"""The one training loop: `run` (the assembly of a run, the loop and the summary), `step` (one optimizer step),
`stages` (the interface every stage answers), `state` (what a step leaves for the stages), and the loop's own stages:
`evaluation`, `nonfinite` (the non-finite guard) and `train_metrics`."""
