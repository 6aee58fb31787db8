"""ResNets written from scratch, in torchvision's layout (no torchvision needed).

    from resnet import resnet50, resnet18, resnet_tiny, ResNet, Bottleneck
    model = resnet50(num_classes=1000)

The layout and parameter names are torchvision's (`conv1`, `bn1`, `layer1` ..
`layer4`, `fc`; each block `conv1..3`, `bn1..3`, `downsample.0/1`), the stride
of a bottleneck sits on its 3x3 convolution ("ResNet v1.5"), and weights are
initialised as torchvision does, so a torchvision state_dict loads as it is.

`width` (64 in the paper) scales every layer's channels and `layers` sets the
number of blocks per stage, so tests can build a network of a few thousand
parameters with exactly the same structure (`resnet_tiny`).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet50", "resnet_tiny",
           "build_model", "ARCHS"]


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4 (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv1x1(cin, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """A ResNet: 7x7/2 stem and 3x3/2 max-pool, four stages of `layers[i]`
    blocks with width * (1, 2, 4, 8) planes (stages 2-4 start with stride 2),
    global average pooling and a linear classifier.

    zero_init_residual: start each block's last BatchNorm at gamma = 0, so
    every block begins as the identity (Goyal et al., 2017: helps large-batch
    training)."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int],
                 num_classes: int = 1000, width: int = 64, zero_init_residual: bool = False):
        super().__init__()
        if len(layers) != 4 or any(n < 1 for n in layers):
            raise ValueError(f"layers: expected 4 positive block counts, got {layers}")
        if width < 1 or num_classes < 1:
            raise ValueError(f"width and num_classes must be positive, got {width}, {num_classes}")
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(block, width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(block, width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)
                elif isinstance(m, BasicBlock):
                    nn.init.zeros_(m.bn2.weight)

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(num_classes: int = 1000, width: int = 64, **kwargs) -> ResNet:
    """ResNet-50: bottleneck blocks [3, 4, 6, 3] (25.6 M parameters at width 64)."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, width, **kwargs)


def resnet18(num_classes: int = 1000, width: int = 64, **kwargs) -> ResNet:
    """ResNet-18: basic blocks [2, 2, 2, 2] (11.7 M parameters at width 64)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, width, **kwargs)


def resnet_tiny(num_classes: int = 10, width: int = 4, **kwargs) -> ResNet:
    """ResNet-50's structure shrunk for tests: one bottleneck per stage, `width`
    channels in the stem (a few tens of thousands of parameters)."""
    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes, width, **kwargs)


ARCHS = {"resnet50": resnet50, "resnet18": resnet18, "tiny": resnet_tiny}


def build_model(arch: str, num_classes: int, width: int | None = None, **kwargs) -> ResNet:
    """One of ARCHS by name; `width` None keeps the architecture's default."""
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {sorted(ARCHS)}, got {arch!r}")
    if width is not None:
        kwargs["width"] = width
    return ARCHS[arch](num_classes=num_classes, **kwargs)
