"""The ladder's training step: the GTC talk's starting point.

ResNet-50 on real JPEGs: LabeledImageDataset (PIL, fp32), random crop and
flip in fp32 on the host, SerialIterator, StandardUpdater, MomentumSGD.
``build`` returns the updater; one ``updater.update()`` is one iteration.
plain.py is plain Chainer; with_fastchain.py is the same file plus the lines
marked ``# fastchain``.
"""

import numpy

import chainer
import chainer.links as L
from chainer import training

import fastchain  # fastchain
from fastchain.models import ResNet

MEAN = numpy.array([123.675, 116.28, 103.53], numpy.float32)[:, None, None]


class Preprocessed(chainer.dataset.DatasetMixin):
    def __init__(self, pairs, root, crop, dtype):
        self.base = chainer.datasets.LabeledImageDataset(pairs, root)
        self.crop = crop
        self.dtype = dtype

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        image, label = self.base[i]
        image = image.astype(self.dtype)            # the talk's fp16 rung: NumPy fp16
        _, h, w = image.shape
        top = numpy.random.randint(0, h - self.crop + 1)
        left = numpy.random.randint(0, w - self.crop + 1)
        image = image[:, top:top + self.crop, left:left + self.crop]
        if numpy.random.randint(2):
            image = image[:, :, ::-1]
        return (image - MEAN.astype(self.dtype)) / self.dtype(255), label


def build(pairs, root, batch, crop, n_classes, device, dtype=numpy.float32):
    fastchain.enable(fp16='auto', static_graph=True)  # fastchain
    model = L.Classifier(ResNet(50, n_classes))
    model.to_device(device)
    optimizer = chainer.optimizers.MomentumSGD(lr=0.01)
    optimizer.setup(model)
    train = Preprocessed(pairs, root, crop, dtype)
    train_iter = chainer.iterators.SerialIterator(train, batch)
    return training.StandardUpdater(train_iter, optimizer, device=device)
