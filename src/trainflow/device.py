"""Waiting for the device: on CUDA the host queues kernels and runs ahead of them, so a clock read on the host
measures the device's work only after a sync. The meter and the stages that pause its clocks use this one."""

import torch


def device_sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a clock read after it measures that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
