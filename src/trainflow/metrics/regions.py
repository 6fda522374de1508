"""The names of the parts of a step the profiler records (torch.profiler.record_function): the step names its
own (data, forward and backward, optimizer), the checkpoint stage its turn; the verdict splits a window by them."""

DATA, FWD_BWD, OPTIMIZER = "trainflow/data", "trainflow/forward_backward", "trainflow/optimizer"
CHECKPOINT = "trainflow/checkpoint"  # the checkpoint stage's turn: its stop-flag polls and saves
