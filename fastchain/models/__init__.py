"""Models the recipes and benchmarks share."""

from fastchain.models.resnet import ResNet, resnet50

__all__ = ['ResNet', 'resnet50']
