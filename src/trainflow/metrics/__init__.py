"""Measured figures: `meter` (throughput, step times, peak memory, FLOPs and MFU), `batch_fit` (batch sizes refused
before anything of their size is allocated) and `activations` (what autograd keeps for backward, block by block)."""
