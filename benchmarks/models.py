"""Models shared by the benchmarks."""

import torch
import torch.nn.functional as F


class BasicBlock(torch.nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c_out)
        self.conv2 = torch.nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(c_out)
        self.short = None
        if stride != 1 or c_in != c_out:
            self.short = torch.nn.Sequential(torch.nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                             torch.nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.short is None else self.short(x)))


class ResNet18(torch.nn.Module):
    """ResNet-18 for 32x32 inputs (the CIFAR variant: 3x3 stem, no max-pool),
    11.2 M parameters in 62 tensors. `width` scales the channels."""

    def __init__(self, num_classes=10, width=64, in_channels=3):
        super().__init__()
        w = width
        self.stem = torch.nn.Conv2d(in_channels, w, 3, 1, 1, bias=False)
        self.bn = torch.nn.BatchNorm2d(w)
        layers, c = [], w
        for i, c_out in enumerate((w, 2 * w, 4 * w, 8 * w)):
            stride = 1 if i == 0 else 2
            layers += [BasicBlock(c, c_out, stride), BasicBlock(c_out, c_out, 1)]
            c = c_out
        self.layers = torch.nn.Sequential(*layers)
        self.fc = torch.nn.Linear(c, num_classes)

    def forward(self, x):
        x = self.layers(F.relu(self.bn(self.stem(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class ManyTensorMLP(torch.nn.Module):
    """A residual MLP of 250 small layers: 500 parameter tensors of 32x32 / 32."""

    def __init__(self, width=32, depth=250, num_classes=10):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.num_classes = num_classes

    def forward(self, x):
        for layer in self.layers:
            x = x + 0.1 * torch.tanh(layer(x))
        return x[:, :self.num_classes]
