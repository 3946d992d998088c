"""Backbones (image -> h) and the MLP used for the projector (h -> z) and the gating head (h -> logits)."""

import torch
import torchvision
from torch import nn

ENCODERS = ("resnet18", "cnn")


def mlp(in_dim: int, hidden: int, out_dim: int, depth: int = 2) -> nn.Sequential:
    """``depth`` Linear layers with ReLU between them and no normalisation, as the reference's
    projector and gating head (depth 2: Linear -> ReLU -> Linear)."""
    if depth < 1:
        raise ValueError(f"an MLP needs depth >= 1, got {depth}")
    dims = [in_dim] + [hidden] * (depth - 1) + [out_dim]
    layers: list[nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers[:-1])


def resnet18(in_channels: int = 3, cifar_stem: bool = False) -> tuple[nn.Module, int]:
    """torchvision ResNet-18, randomly initialised, fc removed -> (module, 512).

    The CIFAR stem is the reference's: conv1 3x3, stride 1, padding 2, no max-pool, so 32 px images
    are not downsampled 4x before the first block.
    """
    net = torchvision.models.resnet18(weights=None)
    if cifar_stem:
        net.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=2, bias=False)
        net.maxpool = nn.Identity()
    elif in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    net.fc = nn.Identity()
    return net, 512


class SmallCNN(nn.Module):
    """Four conv-BN-ReLU blocks (32-64-128-256 channels), each followed by a 2x max-pool, then a global
    average pool: a backbone for 8-32 px images that trains in minutes on a CPU."""

    def __init__(self, in_channels: int = 3, widths: tuple[int, ...] = (32, 64, 128, 256)):
        super().__init__()
        layers: list[nn.Module] = []
        for w in widths:
            # ceil_mode keeps a 1 px map alive when an 8 px input has been halved three times
            layers += [nn.Conv2d(in_channels, w, 3, padding=1, bias=False), nn.BatchNorm2d(w),
                       nn.ReLU(inplace=True), nn.MaxPool2d(2, ceil_mode=True)]
            in_channels = w
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.out_dim = widths[-1]

    def forward(self, x):
        return self.features(x)


def build_backbone(name: str, in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """(backbone, feature width) for an encoder name; ResNet-18 gets the CIFAR stem below 64 px."""
    if name == "resnet18":
        return resnet18(in_channels, cifar_stem=image_size < 64)
    if name == "cnn":
        net = SmallCNN(in_channels)
        return net, net.out_dim
    raise ValueError(f"unknown encoder {name!r}; expected one of {ENCODERS}")


class Encoder(nn.Module):
    """image (R x C x S x S) -> (h: R x D backbone features, z: R x K projector output)."""

    def __init__(self, backbone: str, in_channels: int, image_size: int, proj_hidden: int, proj_dim: int):
        super().__init__()
        self.backbone, self.feat_dim = build_backbone(backbone, in_channels, image_size)
        self.projector = mlp(self.feat_dim, proj_hidden, proj_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.backbone(x)
        return h, self.projector(h)
