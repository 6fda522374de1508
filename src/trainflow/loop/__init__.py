"""The one training loop: `step` (one optimizer step), `stages` (the interface every stage answers), `state` (what a
step leaves for the stages), `meter` (the throughput meter that times every step), `configured` (the config's
`stages` list), and the loop's own stages: `evaluation` and `train_metrics`. The assembly that builds it is
trainflow.run.assembly; trainflow.run.training runs it."""
