"""Preprocessing the benchmarks' comparison rows share: the GTC talk's fp32
random crop and flip, and a PyTorch dataset doing the same with PIL."""

import os

import numpy


def random_crop_flip(chw, crop):
    """A random ``crop`` x ``crop`` window of a CHW array, flipped half the time."""
    _, h, w = chw.shape
    top = numpy.random.randint(0, h - crop + 1)
    left = numpy.random.randint(0, w - crop + 1)
    out = chw[:, top:top + crop, left:left + crop]
    return out[:, :, ::-1] if numpy.random.randint(2) else out


def list_pairs(paths):
    """(path relative to the root, label) of an ImageNet-style list file."""
    with open(paths['train']) as f:
        return [(l.split()[0], int(l.split()[1])) for l in f.read().split('\n') if l]


def torch_dataset(paths, crop, mean, scale):
    """A torch Dataset: PIL decode, fp32 crop and flip, (x - mean) * scale."""
    import torch
    from PIL import Image

    class Images(torch.utils.data.Dataset):
        def __init__(self):
            self.pairs = [(os.path.join(paths['root'], p), t) for p, t in list_pairs(paths)]

        def __len__(self):
            return len(self.pairs)

        def __getitem__(self, i):
            path, label = self.pairs[i]
            image = numpy.asarray(Image.open(path).convert('RGB'), numpy.float32)
            image = random_crop_flip(image.transpose(2, 0, 1), crop)
            return torch.from_numpy(numpy.ascontiguousarray((image - mean) * scale)), label

    return Images()
