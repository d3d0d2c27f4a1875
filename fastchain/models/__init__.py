"""Models the recipes and benchmarks share."""

from fastchain.models.resnet import CifarResNet, ResNet, resnet50

__all__ = ['CifarResNet', 'ResNet', 'resnet50']
