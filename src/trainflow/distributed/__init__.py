"""Training on many processes, one module per concern:

- process_group: this process as one rank (DistEnv, the checks that need the world size or the hardware,
  joining and leaving the group, the collectives the stages share);
- health: the start-up check that the ranks agree;
- parallelism: tensor parallel, activation checkpointing, DDP, FSDP2 and HSDP wrapping, gradient sync control;
- mesh: the degrees (replicate x shard x tp) on one named device mesh, and what a layout does (the one module
  that knows the strategy names);
- tensor: tensor parallel by the model's plan;
- memory_estimate: the per-rank bytes of one layout (data parallel, TP), before training;
- memory_plan: parallelism=auto, the ladder of layouts, the choice and its check after training;
- pipeline: pipeline stages and their schedule.

The package sits below the training loop (pyproject.toml's layers): the stages that watch a distributed run
(watchdog, stragglers, parity, fault tolerance) are trainflow.guards, the launch is trainflow.run.launch. The stages
take a `DistEnv`, the one name the package itself exports.
"""

from trainflow.distributed.process_group import DistEnv

__all__ = ["DistEnv"]
