"""ResNet-50 v1.5 in PyTorch, for the ladder's comparison row (torchvision
has no CPU build on this registry, so the model is written out here, with
the same layout as fastchain.models.ResNet)."""

import torch
from torch import nn


class Bottleneck(nn.Module):
    def __init__(self, n_in, width, stride):
        super().__init__()
        n_out = width * 4
        self.conv1 = nn.Conv2d(n_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, n_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(n_out)
        self.proj = None
        if stride != 1 or n_in != n_out:
            self.proj = nn.Sequential(nn.Conv2d(n_in, n_out, 1, stride, bias=False),
                                      nn.BatchNorm2d(n_out))

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return torch.relu(h + (self.proj(x) if self.proj is not None else x))


class ResNet50(nn.Module):
    def __init__(self, n_classes=1000, width=64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        blocks, n_in = [], width
        for i, n in enumerate((3, 4, 6, 3)):
            w = width * 2 ** i
            for j in range(n):
                blocks.append(Bottleneck(n_in, w, (1 if i == 0 else 2) if j == 0 else 1))
                n_in = w * 4
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(n_in, n_classes)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = nn.functional.max_pool2d(h, 3, 2, 1)
        h = self.blocks(h)
        return self.fc(h.mean((2, 3)))


def resnet50(n_classes=1000, width=64):
    return ResNet50(n_classes, width)


def trainer(n_classes, device, width=64):
    """ResNet-50 on ``device`` (a torch.device) trained as PyTorch's users
    train: on a GPU with cuDNN's autotuner (``cudnn.benchmark``), the model
    in channels-last, AMP (fp16 autocast with its GradScaler) and batches
    copied without blocking; on a CPU in fp32. Returns ``train(x, t)``, one
    SGD step (momentum 0.9) on a host batch, with ``train.optimizer``."""
    on_gpu = device.type == 'cuda'
    if on_gpu:
        torch.backends.cudnn.benchmark = True
    layout = torch.channels_last if on_gpu else torch.contiguous_format
    model = resnet50(n_classes, width).to(device).to(memory_format=layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler('cuda', enabled=on_gpu)

    def train(x, t):
        x = x.to(device, non_blocking=True).contiguous(memory_format=layout)
        t = t.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16, enabled=on_gpu):
            loss = torch.nn.functional.cross_entropy(model(x), t)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    train.optimizer = optimizer
    return train
