"""ResNet v1.5 (He et al. 2016, with the stride on the 3x3 convolution, as in
NVIDIA's and torchvision's ResNet-50; 25,557,032 parameters at depth 50, as
torchvision's). Two differences from Chainer's example ResNet-50 (v1: the
stride on the first 1x1 convolution, a stem convolution with a bias, a 3x3
max pooling without padding and a 7x7 average pooling): the v1.5 layout, and
each block's last BatchNormalization starting at gamma=0 by default
(``zero_init_residual``, as Goyal et al. 2017 for large batches; Chainer's
example and torchvision start it at 1).

Link names follow the usual paths, so per-link NVTX ranges read
``res3/a/conv2``: stages ``res2``..``res5``, blocks ``a``, ``b``, ...,
convolutions ``conv1``..``conv3`` with batch norms ``bn1``..``bn3``, and the
projection ``proj``/``proj_bn``.
"""

import string

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import initializers

_DEPTHS = {18: ('basic', (2, 2, 2, 2)), 34: ('basic', (3, 4, 6, 3)),
           50: ('bottleneck', (3, 4, 6, 3)), 101: ('bottleneck', (3, 4, 23, 3)),
           152: ('bottleneck', (3, 8, 36, 3))}


def _conv(n_in, n_out, k, stride=1):
    return L.Convolution2D(n_in, n_out, k, stride, k // 2, nobias=True,
                           initialW=initializers.HeNormal())


class _Block(chainer.Chain):
    """What both block kinds share: the shortcut (a strided 1x1 projection
    where the shape changes, else the identity) and the final add + ReLU."""

    def _add_projection(self, n_in, n_out, stride):
        # Called inside init_scope, so the links register as proj/proj_bn.
        if stride != 1 or n_in != n_out:
            self.proj = _conv(n_in, n_out, 1, stride)
            self.proj_bn = L.BatchNormalization(n_out)

    def _residual(self, h, x):
        shortcut = self.proj_bn(self.proj(x)) if hasattr(self, 'proj') else x
        return F.relu(h + shortcut)


class Bottleneck(_Block):
    """1x1 -> 3x3 (stride here: v1.5) -> 1x1, expansion 4."""

    expansion = 4

    def __init__(self, n_in, width, stride, zero_init_residual):
        super().__init__()
        n_out = width * self.expansion
        with self.init_scope():
            self.conv1 = _conv(n_in, width, 1)
            self.bn1 = L.BatchNormalization(width)
            self.conv2 = _conv(width, width, 3, stride)
            self.bn2 = L.BatchNormalization(width)
            self.conv3 = _conv(width, n_out, 1)
            self.bn3 = L.BatchNormalization(
                n_out, initial_gamma=0 if zero_init_residual else None)
            self._add_projection(n_in, n_out, stride)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return self._residual(self.bn3(self.conv3(h)), x)


class Basic(_Block):
    """3x3 -> 3x3, expansion 1 (ResNet-18/34)."""

    expansion = 1

    def __init__(self, n_in, width, stride, zero_init_residual):
        super().__init__()
        with self.init_scope():
            self.conv1 = _conv(n_in, width, 3, stride)
            self.bn1 = L.BatchNormalization(width)
            self.conv2 = _conv(width, width, 3)
            self.bn2 = L.BatchNormalization(
                width, initial_gamma=0 if zero_init_residual else None)
            self._add_projection(n_in, width, stride)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return self._residual(self.bn2(self.conv2(h)), x)


class Stage(chainer.Chain):
    """Blocks named ``a``, ``b``, ``c``... (so paths read ``res3/a/conv2``)."""

    def __init__(self, block, n_in, width, n_blocks, stride, zero_init_residual):
        super().__init__()
        self.names = list(string.ascii_lowercase[:n_blocks]) if n_blocks <= 26 \
            else ['b{}'.format(i) for i in range(n_blocks)]
        with self.init_scope():
            for i, name in enumerate(self.names):
                setattr(self, name, block(n_in, width, stride if i == 0 else 1,
                                          zero_init_residual))
                n_in = width * block.expansion

    def forward(self, x):
        for name in self.names:
            x = self[name](x)
        return x


class ResNet(chainer.Chain):
    """ResNet v1.5 for ``n_classes`` classes.

    Args:
        depth (int): 18, 34, 50, 101 or 152.
        n_classes (int): outputs of the final linear layer.
        width (int): channels of the first stage (64 in the paper); smaller
            values give a cheaper model of the same shape for tests.
        zero_init_residual (bool): start each block's last BN at gamma=0
            (each block begins as the identity; helps large-batch training).
    """

    def __init__(self, depth=50, n_classes=1000, width=64, zero_init_residual=True):
        super().__init__()
        kind, blocks = _DEPTHS[depth]
        block = Bottleneck if kind == 'bottleneck' else Basic
        self.depth = depth
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, width, 7, 2, 3, nobias=True,
                                         initialW=initializers.HeNormal())
            self.bn1 = L.BatchNormalization(width)
            n_in = width
            for i, n in enumerate(blocks):
                w = width * 2 ** i
                setattr(self, 'res{}'.format(i + 2),
                        Stage(block, n_in, w, n, 1 if i == 0 else 2, zero_init_residual))
                n_in = w * block.expansion
            self.fc = L.Linear(n_in, n_classes)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.max_pooling_2d(h, 3, 2, 1, cover_all=False)
        for i in range(2, 6):
            h = getattr(self, 'res{}'.format(i))(h)
        h = F.average(h, axis=(2, 3))
        return self.fc(h)


def resnet50(n_classes=1000, **kwargs):
    return ResNet(50, n_classes, **kwargs)


class CifarResNet(chainer.Chain):
    """The CIFAR-size ResNet of He et al. (2016, section 4.2): a 3x3 stem,
    three stages of ``(depth - 2) / 6`` basic blocks at ``width``,
    ``2 width`` and ``4 width`` channels (strides 1, 2, 2), global average
    pooling and a linear layer, for 32x32 inputs. Where a stage changes the
    width, the shortcut is a 1x1 convolution with BatchNormalization (the
    paper's option B; its CIFAR networks use option A, zero-padded identity
    shortcuts): ``depth=20`` at width 16 has 272,474 parameters, where the
    paper's ResNet-20 has 0.27 M.
    """

    def __init__(self, depth=20, n_classes=10, width=16, in_channels=3,
                 zero_init_residual=False):
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError('depth must be 6n + 2 (20, 32, 44, 56, 110), got {!r}'.format(
                depth))
        n = (depth - 2) // 6
        self.depth = depth
        with self.init_scope():
            self.conv1 = _conv(in_channels, width, 3)
            self.bn1 = L.BatchNormalization(width)
            n_in = width
            for i in range(3):
                w = width * 2 ** i
                setattr(self, 'res{}'.format(i + 2),
                        Stage(Basic, n_in, w, n, 1 if i == 0 else 2, zero_init_residual))
                n_in = w
            self.fc = L.Linear(n_in, n_classes)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        for i in range(2, 5):
            h = getattr(self, 'res{}'.format(i))(h)
        return self.fc(F.average(h, axis=(2, 3)))

