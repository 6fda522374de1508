"""A small convolutional classifier for little images (scikit-learn's 8x8 digits by default).

The convolution stages sit in `self.blocks` (an nn.Sequential), so FSDP shards, activation checkpointing and
compile.scope=blocks work on them as on the GPT's blocks.
"""

import torch
from torch import nn


class ConvBlock(nn.Module):
    """Two 3x3 convolutions, then a 2x2 max pool halving the image."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(out_channels, out_channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    def __init__(self, in_channels: int = 1, image_size: int = 8, width: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        if image_size % 4:
            raise ValueError(f"image_size ({image_size}) must be divisible by 4 (two 2x2 poolings)")
        self.blocks = nn.Sequential(ConvBlock(in_channels, width), ConvBlock(width, 2 * width))
        self.head = nn.Linear(2 * width * (image_size // 4) ** 2, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(images).flatten(1))
