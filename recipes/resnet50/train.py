#!/usr/bin/env python
"""Train ResNet-50 v1.5 with fastchain (README.md beside it: sizes, flags, outputs).

    python recipes/resnet50/train.py --config recipes/resnet50/demo.yaml --all  # make demo
    python recipes/resnet50/train.py --data /path/to/imagenet --all --epochs 90
    python recipes/resnet50/train.py --data synthetic --all     # speed only

``--data PATH`` takes Chainer's ImageNet list format (``PATH/train.txt`` and
``PATH/val.txt`` of ``relative/path label`` lines) or one folder per class
(``PATH/train/<class>/...`` and ``PATH/val/<class>/...``). ``--data demo``
makes a small learnable set of real JPEG files (shapes and colours) on first
use; ``--data synthetic`` feeds random images of the right shape.

Each accelerator has a flag (``--fp16``, ``--autotune``, ``--loaderjobs N``,
``--static-graph``, ``--nvtx``); ``--all`` turns on everything that helps on
the device present, through one ``fastchain.enable()`` call. The same script
trains data-parallel under ``mpiexec -n N`` or ``fastchain-run -n N``: each
process takes one GPU (or the CPU), its own shard of the data, and the
learning rate follows the global batch. Options can also
come from ``--config file.yaml`` (keys are the option names with underscores);
the resolved configuration is saved as ``config.json`` in ``--out``.
"""

import argparse
import gc
import json
import math
import os
import pickle
import statistics
import sys
import time
import warnings
import zipfile

import numpy

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training
from chainer.training import extensions

import fastchain
from fastchain import data, distributed
from fastchain.models import ResNet

HERE = os.path.dirname(os.path.abspath(__file__))


# --- options -------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--config', help='YAML file of option values (command line wins)')

    g = p.add_argument_group('data')
    g.add_argument('--data', default='demo', help="a dataset directory, 'demo' or 'synthetic'")
    g.add_argument('--image-size', type=int, default=224, help='training crop size')
    g.add_argument('--demo-per-class', type=int, default=300,
                   help='--data demo: training images per class (validation: a fifth)')
    g.add_argument('--demo-root', default=None,
                   help='--data demo: where the generated files go (default: '
                        'recipes/resnet50/.data/demo-<image size>px-<per class>, one set '
                        'each, so runs at two sizes do not remake each other\'s)')
    g.add_argument('--skip-bad-images', action='store_true',
                   help='leave images that cannot be read out of their batch (counted in '
                        'the log as skipped_examples) instead of stopping')
    g.add_argument('--batch-size', type=int, default=32, help='per process')
    g.add_argument('--val-batch-size', type=int, default=64, help='per process')

    g = p.add_argument_group('model')
    g.add_argument('--depth', type=int, default=50, choices=(18, 34, 50, 101, 152),
                   help='layers')
    g.add_argument('--width', type=int, default=64, help='channels of the first stage')

    g = p.add_argument_group('optimisation')
    g.add_argument('--epochs', type=float, default=90, help='length of the run (and of its '
                   'learning-rate schedule)')
    g.add_argument('--iterations', type=int, default=None,
                   help='stop after this many iterations instead')
    g.add_argument('--lr', type=float, default=0.1, help='for a global batch of 256; '
                   'scaled linearly with the global batch')
    g.add_argument('--momentum', type=float, default=0.9, help="MomentumSGD's momentum")
    g.add_argument('--weight-decay', type=float, default=5e-5, help='L2, as a WeightDecay hook')
    g.add_argument('--warmup-epochs', type=float, default=1.0,
                   help='linear learning-rate warm-up from 0')
    g.add_argument('--schedule', choices=('cosine', 'step'), default='cosine',
                   help='learning-rate decay after the warm-up')
    g.add_argument('--label-smoothing', type=float, default=0.0, help='epsilon (0: none)')

    g = p.add_argument_group('accelerators')
    g.add_argument('--all', action='store_true',
                   help='every accelerator that helps on this device (one enable() call)')
    g.add_argument('--fp16', action='store_true', help='fp16 compute, fp32 masters, loss scaling')
    g.add_argument('--fp32', action='store_true',
                   help='fp32 compute even with --all (which turns fp16 on where TensorCores '
                        'are: a GPU of compute capability 7.0 or more)')
    g.add_argument('--autotune', action='store_true',
                   help="measure and choose: cuDNN's algorithms where cuDNN works, "
                   "fastchain's bitwise-equal CPU kernels, fused update and static "
                   'cache everywhere (on by default; this flag asks for it explicitly)')
    g.add_argument('--no-autotune', action='store_true',
                   help="autotune off: cuDNN's heuristics' first plan and fastchain's "
                        'defaults, nothing measured (no tuning steps at the start)')
    g.add_argument('--loaderjobs', type=int, default=None,
                   help="loader worker processes (0: load in the main process; default: "
                   "0, or with --all this process's share of the node's cores)")
    g.add_argument('--static-graph', action='store_true', help='cache static subgraphs')
    g.add_argument('--nvtx', action='store_true', help='NVTX ranges for nsys')
    g.add_argument('--timeline', metavar='PATH',
                   help="record fastchain's ranges; write a Chrome trace, PNG and summary")

    g = p.add_argument_group('run')
    g.add_argument('--out', default='result/resnet50',
                   help='folder of the log, plots, config.json, speed.txt and snapshots')
    g.add_argument('--device', default=None,
                   help="Chainer device ('@numpy', '@cupy:0'); default: GPU 0 if present")
    g.add_argument('--seed', type=int, default=0,
                   help='of the weights, the data order and the augmentation')
    g.add_argument('--resume', help='a snapshot to continue from, with the options of the '
                   'run that wrote it (--epochs and --iterations may change)')
    g.add_argument('--resume-with-changes', action='store_true',
                   help='--resume with other training options than the run that wrote it '
                        '(refused without this)')
    g.add_argument('--snapshot-every', type=float, default=1.0,
                   help='epochs between snapshots (and one at the end of every run)')
    g.add_argument('--keep-snapshots', type=int, default=2,
                   help='how many of the newest snapshots to keep (0: all)')
    g.add_argument('--no-snapshots', action='store_true',
                   help='write none (a ResNet-50 snapshot is about 190 MB: weights, '
                   'momentum, and fp32 masters with --fp16)')
    g.add_argument('--log-every', type=int, default=10, help='iterations')
    g.add_argument('--no-progress', action='store_true', help='no progress bar')

    args, _ = p.parse_known_args(argv)
    configured = {}
    if args.config:
        configured = read_config(p, args.config)
        p.set_defaults(**configured)
    args = p.parse_args(argv)

    def where(name):
        # a value from the --config file is named there
        value = getattr(args, name)
        return ' (from --config {})'.format(args.config) if name in configured and \
            configured[name] == value else ''
    for name in POSITIVE + NON_NEGATIVE:
        value = getattr(args, name)
        if value is not None and not (value > 0 if name in POSITIVE else value >= 0):
            p.error('--{} {}{}: expected a number {}'.format(
                name.replace('_', '-'), value, where(name),
                'above 0' if name in POSITIVE else '>= 0'))
    for name in BELOW_1:
        if not getattr(args, name) < 1:
            p.error('--{} {}{}: expected a number below 1'.format(
                name.replace('_', '-'), getattr(args, name), where(name)))
    return args


POSITIVE = ('image_size', 'demo_per_class', 'batch_size', 'val_batch_size', 'width', 'epochs',
            'iterations', 'lr', 'log_every', 'snapshot_every')
NON_NEGATIVE = ('momentum', 'weight_decay', 'warmup_epochs', 'label_smoothing')
BELOW_1 = ('momentum', 'label_smoothing')     # a momentum of 1 or more never forgets


def read_config(p, path):
    """The options in the YAML file ``path``, checked as the command line
    checks them (argparse checks no default it is given)."""
    import difflib
    import yaml
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except OSError as e:
        p.error('--config {}: {}'.format(path, e.strerror or e))
    except yaml.YAMLError as e:
        p.error('--config {}: not valid YAML ({})'.format(path, e))
    if not isinstance(values, dict):
        p.error('--config {}: expected option: value lines, found {}'.format(
            path, type(values).__name__))
    actions = {a.dest: a for a in p._actions if a.dest not in ('help', 'config')}
    for name in sorted(set(values) - set(actions), key=str):
        close = difflib.get_close_matches(str(name).replace('-', '_'), actions, n=1)
        p.error('{}: unknown option {!r}{}'.format(
            path, name, " (did you mean '{}'?)".format(close[0]) if close else ''))
    for name, value in values.items():
        action = actions[name]
        where = '{}: {} (--{})'.format(path, name, name.replace('_', '-'))
        if action.nargs == 0:           # a flag: true or false
            if not isinstance(value, bool):
                p.error('{}: expected true or false, got {!r}'.format(where, value))
            continue
        if value is None:
            if action.default is not None:
                p.error('{}: expected a value (its default is {!r}); leave the key out '
                        'for the default'.format(where, action.default))
            continue
        kind = action.type
        if kind is not None:
            exact = not isinstance(value, bool) and (
                kind is not int or isinstance(value, (int, str)))
            try:
                converted = kind(value) if exact else None
            except (TypeError, ValueError):
                converted = None
            if converted is None:
                p.error('{}: expected {} {}, got {!r}'.format(
                    where, 'an' if kind is int else 'a', getattr(kind, '__name__', kind),
                    value))
            value = values[name] = converted
        if action.choices is not None and value not in action.choices:
            p.error('{}: {!r} is not one of {}'.format(
                where, value, ', '.join(map(str, action.choices))))
    return values


# --- accelerators --------------------------------------------------------------

def enable_accelerators(args):
    """One fastchain.enable() call from the flags; the handle is returned."""
    from fastchain.config import _options
    known = _options.all_options()
    options = {}
    if args.all:
        options.update(autotune=None, fp16='auto', loader_workers=None,
                       static_graph=True, nvtx=None)
    if args.fp16 and args.fp32:
        sys.exit('--fp16 and --fp32 contradict each other: give one')
    if args.fp16:
        options['fp16'] = True
    if args.fp32:
        options['fp16'] = False
    if args.autotune and args.no_autotune:
        sys.exit('--autotune and --no-autotune contradict each other: give one')
    if args.autotune:
        options['autotune'] = True
    if args.no_autotune:
        options['autotune'] = False
    if args.static_graph:
        options['static_graph'] = True
    if args.nvtx:
        options['nvtx'] = True
    if args.timeline:
        folder = os.path.dirname(os.path.abspath(args.timeline))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            sys.exit('--timeline {}: cannot make the folder {} ({})'.format(
                args.timeline, folder, e.strerror or e))
        options['timeline'] = args.timeline
    # The recipe builds its own iterators; only the updater-level loader
    # switch would apply to a plain script.
    options['loader_workers'] = 0
    args.not_available = sorted(set(options) - set(known))
    for name in args.not_available:
        if options.pop(name) is not None and not args.all:
            warnings.warn('--{}: not available in this version of fastchain yet; '
                          'running without it'.format(name.replace('_', '-')))
    try:
        return fastchain.enable(**options)
    except (ValueError, OSError) as e:
        if 'timeline' not in options:
            raise
        sys.exit('--timeline {}: {}'.format(args.timeline, e))


# --- data ----------------------------------------------------------------------

def make_datasets(args):
    size = args.image_size
    train_tf = data.RandomResizedCrop(size, scale=(0.25, 1.0))
    val_tf = data.CenterCrop(size)
    if args.data == 'synthetic':
        rng = numpy.random.RandomState(args.seed)
        n = args.batch_size * 8
        x = rng.randint(0, 256, (n, 3, size, size)).astype(numpy.uint8)
        t = rng.randint(0, 1000, n).astype(numpy.int32)
        ds = chainer.datasets.TupleDataset(x, t)
        return ds, ds, 1000
    if args.data == 'demo':
        per_class = args.demo_per_class
        root = args.demo_root or os.path.join(HERE, '.data', 'demo-{}px-{}'.format(
            size, per_class))
        side = (max(size, int(size * 1.5)), max(size, int(size * 2.5)))
        paths = data.make_demo_dataset(root, n_train=per_class,
                                       n_val=max(1, per_class // 5), size=side)
        return (data.ImageListDataset(paths['train'], root, train_tf),
                data.ImageListDataset(paths['val'], root, val_tf), len(paths['classes']))
    if not os.path.isdir(args.data):
        sys.exit("--data {}: {}; expected 'demo', 'synthetic', or a dataset directory".format(
            args.data, 'not a directory' if os.path.exists(args.data) else
            'no such directory'))
    listed = os.path.exists(os.path.join(args.data, 'train.txt'))   # takes precedence
    for listing, other in (('train.txt', 'val.txt'), ('train', 'val'))[:1 if listed else 2]:
        if os.path.exists(os.path.join(args.data, listing)) and \
                not os.path.exists(os.path.join(args.data, other)):
            sys.exit('--data {}: has {} but no {} (the validation set, in the same form)'
                     .format(args.data, listing, other))
    if os.path.exists(os.path.join(args.data, 'train.txt')):
        train = data.ImageListDataset(os.path.join(args.data, 'train.txt'), args.data, train_tf)
        val = data.ImageListDataset(os.path.join(args.data, 'val.txt'), args.data, val_tf)
        n_classes = 1 + max(max(train.label(i) for i in range(len(train))),
                            max(val.label(i) for i in range(len(val))))
        return train, val, n_classes
    if os.path.isdir(os.path.join(args.data, 'train')):
        train = data.ImageFolderDataset(os.path.join(args.data, 'train'), train_tf)
        # labelled with train's classes: a class missing from val/ shifts nothing
        val = data.ImageFolderDataset(os.path.join(args.data, 'val'), val_tf,
                                      classes=train.classes)
        if val.missing:
            print('--data {}: val/ has no folder for {} of the {} classes ({}); they are '
                  'not validated'.format(args.data, len(val.missing), len(train.classes),
                                         ', '.join(val.missing)))
        return train, val, len(train.classes)
    sys.exit("--data {}: expected 'demo', 'synthetic', a directory with train.txt and "
             "val.txt, or one with train/ and val/ class folders".format(args.data))


# --- training pieces -------------------------------------------------------------

def smoothed_cross_entropy(epsilon):
    def loss(y, t):
        ce = F.softmax_cross_entropy(y, t)
        if epsilon == 0:
            return ce
        uniform = -F.mean(F.log_softmax(y))
        return (1 - epsilon) * ce + epsilon * uniform
    return loss


def lr_at(args, base_lr, iters_per_epoch, total_iters):
    warmup = args.warmup_epochs * iters_per_epoch

    def schedule(iteration):
        if iteration < warmup:
            return base_lr * (iteration + 1) / warmup
        if args.schedule == 'cosine':
            progress = (iteration - warmup) / max(1, total_iters - warmup)
            return 0.5 * base_lr * (1 + math.cos(math.pi * min(1.0, progress)))
        # step: /10 at 30, 60 and 80 of 90 epochs, as fractions of the run's
        # length (--iterations too)
        return base_lr * 0.1 ** sum(iteration >= f * total_iters for f in (1 / 3, 2 / 3, 8 / 9))
    return schedule


def fp32_masters_into(path, model):
    """Where the snapshot at ``path`` was written with fp16 (fastchain keeps
    each fp16 weight's fp32 master beside it) and ``model``'s weights are
    fp32: put the masters in them (Chainer's load gave them the fp16 copies,
    rounded). Returns how many; 0 where the snapshot has none or the model
    is in fp16 (its optimizer loaded them)."""
    params = dict(model.namedparams())
    found = 0
    with numpy.load(path) as snapshot:
        for key in snapshot.files:
            if '/fastchain_fp32_masters/' not in key:
                continue
            name = '/' + key.split('/fastchain_fp32_masters/', 1)[1].replace('.', '/')
            param = params.get(name)
            if param is None or param.array is None or param.dtype != numpy.float32:
                continue
            param.array[...] = param.device.send(snapshot[key].astype(numpy.float32))
            found += 1
    return found


class ValidationSkips(training.Extension):
    """Reports ``validation/skipped_examples``: the images the evaluation just
    run left out (all processes'). The validation iterator's own report is
    made outside the evaluator's observation and would be lost."""

    priority = training.PRIORITY_WRITER     # after the evaluator, before the log

    def __init__(self, iterator, comm):
        self.iterator, self.comm, self.seen = iterator, comm, 0

    def __call__(self, trainer):
        count = len(self.iterator.skipped) - self.seen
        self.seen += count
        if self.comm is not None:
            count = self.comm.allreduce_obj(count, what='counting skipped validation images')
        chainer.report({'validation/skipped_examples': count})

    def serialize(self, serializer):
        pass        # counts per evaluation: nothing to carry over a resume


class SkippedBefore(training.Extension):
    """With --skip-bad-images and snapshots, on every process: what every
    process left out so far, gathered just before each snapshot and saved in
    it, so that a resumed run's ``skipped.json`` lists the whole training's
    images (a resumed run's loaders start their lists afresh; the ones left
    out before the snapshot were missing, and the log's counts disagreed)."""

    priority = -99      # just before Chainer's snapshot (-100), the same trigger

    def __init__(self, iterators, comm):
        self.iterators, self.comm = iterators, comm
        self.before = {name: [] for name in iterators}  # loaded: all processes', earlier runs
        self.gathered = None

    def everyone(self):
        """Every process's lists so far, this run's, with those loaded."""
        found = {name: it.skipped for name, it in self.iterators.items()}
        every = self.comm.allgather_obj(found, what='gathering the images left out') \
            if self.comm is not None else [found]
        return {name: list(self.before.get(name, ())) + [e for process in every
                                                          for e in process[name]]
                for name in self.iterators}

    def __call__(self, trainer):
        self.gathered = self.everyone()

    def serialize(self, serializer):
        if isinstance(serializer, chainer.serializer.Deserializer):
            try:
                saved = serializer('skipped_json', None)
            except KeyError:        # a snapshot of a run without --skip-bad-images
                return
            self.before = json.loads(bytes(numpy.asarray(saved, numpy.uint8)).decode())
            return
        text = json.dumps(self.gathered if self.gathered is not None else self.before)
        serializer('skipped_json', numpy.frombuffer(text.encode(), numpy.uint8))


def write_skipped(args, iterators, comm, rank, before=None):
    """With --skip-bad-images: the images left out (every process's, and
    those a resumed snapshot holds from before it: ``before``), by file and
    with the error, in ``skipped.json`` under --out, and one line saying
    how many (the log's counts say when, not which)."""
    if before is None:
        before = SkippedBefore(iterators, comm)
    everyone = before.everyone()
    if rank != 0:
        return
    listing, said = {}, []
    for name in iterators:
        files = {}
        for entry in everyone[name]:
            key = entry['path'] or 'example {}'.format(entry['index'])
            files.setdefault(key, {'file': key, 'error': entry['error'], 'times': 0})
            files[key]['times'] += 1
        listing[name] = sorted(files.values(), key=lambda f: f['file'])
        times = sum(f['times'] for f in files.values())
        said.append('{} {} image{} ({} time{})'.format(
            len(files), name, '' if len(files) == 1 else 's', times, '' if times == 1 else 's'))
    path = os.path.join(args.out, 'skipped.json')
    with open(path, 'w') as f:
        json.dump(listing, f, indent=2)
    print('--skip-bad-images: left out {}; listed in {}'.format(' and '.join(said), path),
          flush=True)


class LogTrigger:
    """Every ``n`` iterations and at the last one (so the final evaluation
    reaches the log even when ``n`` does not divide the run)."""

    def __init__(self, n, last):
        self.n, self.last = n, last

    def __call__(self, trainer):
        i = trainer.updater.iteration
        return i % self.n == 0 or i == self.last

    def serialize(self, serializer):
        pass


def batch_too_large(args, world, examples):
    """The message refusing a global batch larger than the training set, or
    None. Synthetic data is sized by the batch (8 batches of one process)."""
    if args.data == 'synthetic' or args.batch_size * world <= examples:
        return None
    return ('--batch-size {}: the global batch ({} process(es) x {}) is larger than the {} '
            'training examples, so each batch would hold some of them several times; give at '
            'most {}'.format(args.batch_size, world, args.batch_size, examples,
                             max(1, examples // world)))


# What a run trains with: a resume with other values would go on as another
# run (its schedule, batch or model from there on), so it is refused unless
# asked for. --epochs and --iterations may change (a longer run stretches the
# schedule, as documented); --seed only drew what the snapshot holds.
TRAINING_OPTIONS = ('batch_size', 'image_size', 'depth', 'width', 'lr', 'momentum',
                    'weight_decay', 'warmup_epochs', 'schedule', 'label_smoothing')


class RunRecord(training.Extension):
    """Keeps ``record`` (the training options, the number of processes, the
    dataset's size and classes) in the snapshots, read back by
    :func:`recorded_run`; it does nothing in the loop."""

    name = 'run_record'
    KEY = 'extensions/run_record/json'

    def __init__(self, record):
        self.record = record

    def __call__(self, trainer):
        pass

    def serialize(self, serializer):
        if isinstance(serializer, chainer.serializer.Serializer):       # saving
            text = json.dumps(self.record, sort_keys=True).encode()
            serializer('json', numpy.frombuffer(text, dtype=numpy.uint8))


UNREADABLE = object()


def recorded_run(path):
    """The record a snapshot keeps; None for one of an older recipe, and
    UNREADABLE for a file :func:`chainer.serializers.load_npz` will name as
    unreadable."""
    try:
        with numpy.load(path) as npz:
            if RunRecord.KEY not in npz.files:
                return None
            return json.loads(bytes(npz[RunRecord.KEY]).decode())
    except Exception:
        return UNREADABLE


def record_of(args, world, examples, n_classes):
    record = {name: getattr(args, name) for name in TRAINING_OPTIONS}
    record.update(processes=world, training_examples=examples, classes=n_classes)
    if world > 1:
        record['seed'] = args.seed      # it also chose each process's shard
    return record


# What the snapshot's own state is shaped by: no resume can change it.
FIXED = ('processes', 'training_examples', 'classes')


def changes(recorded, record, keys=None):
    """'--lr 0.1 there, 0.5 here'-like lines for what differs."""
    labels = {'processes': 'processes', 'training_examples': 'training examples',
              'classes': 'classes'}
    return ['{} {} there, {} here'.format(labels.get(k, '--' + k.replace('_', '-')),
                                          recorded[k], record[k])
            for k in sorted(record) if k in recorded and recorded[k] != record[k]
            and (keys is None or k in keys)]


class SpeedMeter(training.Extension):
    """Median time per iteration (evaluation gaps do not move a median)."""

    trigger = 1, 'iteration'
    priority = training.PRIORITY_READER

    def __init__(self, batch_size, skip=3):
        self.batch_size = batch_size
        self.skip = skip
        self.times = []

    def __call__(self, trainer):
        self.times.append(time.perf_counter())

    def gaps(self):
        return numpy.diff(self.times[self.skip:])

    def images_per_second(self):
        """Images/s of one process, or None for a run too short to tell."""
        gaps = self.gaps()
        return self.batch_size / statistics.median(gaps) if len(gaps) >= 2 else None


def launched_by_mpi():
    """True under mpiexec (MPICH, Open MPI or MVAPICH set one of these)."""
    return any(int(os.environ.get(v, '1')) > 1 for v in
               ('PMI_SIZE', 'OMPI_COMM_WORLD_SIZE', 'MV2_COMM_WORLD_SIZE'))


# The recipe's flag for each accelerator it can turn on.
FLAGS = {'fp16': '--fp16, or --all where a GPU has TensorCores', 'autotune': '--autotune',
         'static_graph': '--static-graph or --all', 'nvtx': '--nvtx (or run under nsys)'}


def loader_state(args):
    """The recipe's own input pipeline (it builds its iterators itself, so
    ``enable()``'s loader, for updaters that it builds, is off)."""
    if args.loaderjobs:
        return {'active': True, 'note': '{} worker process{} + device prefetch (the '
                'recipe\'s own MultiprocessIterator and DevicePrefetcher)'.format(
                    args.loaderjobs, 'es' if args.loaderjobs > 1 else '')}
    return {'active': False, 'why': 'loading in the main process (--loaderjobs 0)',
            'note': 'device prefetch (the recipe\'s own DevicePrefetcher)'}


def speed_report(args, handle, meter, log, device, n_classes, world=1):
    lines = ['', '== speed report ==']
    ips = meter.images_per_second()
    batch = 'global batch {} = {} process(es) x {}, device {}'.format(
        args.batch_size * world, world, args.batch_size, device)
    if ips is None:
        lines.append('training: not measured: {} iteration(s) are too few (the first {} '
                     'warm up; the speed is the median over the rest: run at least {}; {})'
                     .format(len(meter.times), meter.skip, meter.skip + 3, batch))
    else:
        lines.append('training: {:.1f} images/s (median over {} iterations, {})'.format(
            ips * world, len(meter.gaps()), batch))
    accuracy = [e['validation/main/accuracy'] for e in log.log
                if 'validation/main/accuracy' in e]
    if accuracy:
        lines.append('validation accuracy: {:.3f} (chance {:.3f})'.format(
            accuracy[-1], 1.0 / n_classes))
    lines.append('accelerators:')
    report = handle.report()
    for name, s in report.items():
        if name in ('loader', 'prefetch_to_device'):
            continue        # the recipe builds its own pipeline (below)
        calls = (s.get('calls') or {}) if name == 'static_graph' else {}
        fell, order = calls.get('define_by_run'), calls.get('not_bitwise')
        if s['active'] and fell:
            status = 'active, but define-by-run: ' + '; '.join(
                '{}: {}'.format(model, why) for model, why in fell.items())
        elif s['active'] and order:
            status = ('active, not bitwise (gradient terms from outside the call, summed '
                      'in another order; the StaticGraphOrder warning says which): '
                      + ', '.join(order))
        elif s['active']:
            status = 'active'
        elif not s['available']:
            status = 'unavailable: {} (fix: {})'.format(s['why'], s['fix'])
        else:
            status = 'off ({})'.format(s['why'] or 'not asked for' + (
                ': ' + FLAGS[name] if name in FLAGS else ''))
        lines.append('  {:18s} {}'.format(name, status))
    loader = loader_state(args)
    lines.append('  {:18s} {}'.format('loader', 'active: ' + loader['note'] if loader['active']
                                      else 'off: ' + loader['why']))
    for name in getattr(args, 'not_available', []):
        lines.append('  {:18s} not in this version of fastchain yet'.format(name))
    paths = report.get('cudnn', {}).get('calls')
    if paths:
        from fastchain.cudnn._paths import describe as describe_paths
        lines.append('cuDNN graphs, the path each operation took (calls; reasons where not '
                     'a graph):')
        lines.extend('  ' + line for line in describe_paths(paths))
    choices = report.get('autotune', {}).get('choices')
    if choices:
        from fastchain.tune import describe
        lines.append('autotune, what it measured and picked (fastchain.tune.choices() '
                     'has every key):')
        lines.extend('  ' + line for line in describe(choices))
    lines.append(snapshot_line(args))
    text = '\n'.join(lines)
    print(text)
    with open(os.path.join(args.out, 'speed.txt'), 'w') as f:
        f.write(text.lstrip() + '\n')


# --- main ----------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    comm = distributed.create_communicator() if launched_by_mpi() else None
    world, rank = (comm.size, comm.rank) if comm else (1, 0)
    if args.loaderjobs is None:
        # with --all, the cores of this node, shared by its processes
        args.loaderjobs = max(1, data.available_cores() // (
            comm.intra_size if comm else 1)) if args.all else 0
    if args.loaderjobs < 0:
        sys.exit('--loaderjobs {}: give how many loader processes (0: none)'.format(
            args.loaderjobs))
    if args.keep_snapshots < 0:
        sys.exit('--keep-snapshots {}: give how many snapshots to keep (0: all)'.format(
            args.keep_snapshots))
    if rank == 0:
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as e:
            sys.exit('--out {}: cannot make the folder ({}); give a folder path that can be '
                     'created'.format(args.out, e.strerror or e))

    numpy.random.seed(args.seed)
    from fastchain.backends import cuda
    if comm is not None:
        device = comm.device()              # one GPU per process, by local rank
    else:
        try:
            device = cuda.get_device(args.device)   # default: GPU 0 if usable
        except RuntimeError as e:
            sys.exit(str(e))
    device.use()
    if rank == 0 and device.xp is numpy and args.depth >= 50 and args.image_size >= 160 \
            and not args.iterations:
        print('note: ResNet-{} at {} px on a CPU takes about a minute an iteration of 32 '
              'images; for a run of minutes: --config recipes/resnet50/demo.yaml (48 px), '
              'see recipes/resnet50/README.md'.format(args.depth, args.image_size),
              file=sys.stderr, flush=True)
    handle = enable_accelerators(args)      # before the model: fp16 sets its dtype

    if comm is not None and rank != 0 and args.data == 'demo':
        comm.barrier(what='waiting for rank 0 to make the demo data')
    try:
        train, val, n_classes = make_datasets(args)
    except (ValueError, OSError) as e:      # a dataset folder or list that cannot be used
        sys.exit('--data {}: {}'.format(args.data, e))
    except KeyboardInterrupt:
        if comm is not None:
            raise           # fastchain's hooks end every rank (status 130)
        print('\ninterrupted while reading or making the data{}'.format(
            ' (the demo set is made again by the next run)' if args.data == 'demo' else ''),
            file=sys.stderr, flush=True)
        sys.exit(130)
    record = record_of(args, world, len(train), n_classes)
    too_large = batch_too_large(args, world, len(train))
    if too_large:
        sys.exit(too_large if rank == 0 else 1)
    if comm is not None:
        if rank == 0 and args.data == 'demo':
            comm.barrier(what='waiting for rank 0 to make the demo data')
        train = distributed.scatter_dataset(train, comm, shuffle=True, seed=args.seed)
        val = distributed.scatter_dataset(val, comm)
    model = L.Classifier(ResNet(args.depth, n_classes, width=args.width),
                         lossfun=smoothed_cross_entropy(args.label_smoothing))
    model.to_device(device)

    global_batch = args.batch_size * world
    base_lr = args.lr * global_batch / 256
    optimizer = chainer.optimizers.MomentumSGD(lr=base_lr, momentum=args.momentum)
    if comm is not None:
        optimizer = distributed.create_multi_node_optimizer(optimizer, comm)
    optimizer.setup(model)
    if args.weight_decay:
        optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(args.weight_decay))

    converter = data.ImageConverter()
    on_error = 'skip' if args.skip_bad_images else 'raise'
    try:
        train_it = data.MultiprocessIterator(train, args.batch_size, seed=args.seed,
                                             n_workers=args.loaderjobs, on_error=on_error)
        val_it = data.MultiprocessIterator(val, args.val_batch_size, repeat=False,
                                           shuffle=False, n_workers=args.loaderjobs,
                                           on_error=on_error)
    except data.DataLoadError as e:     # none of the first images loads (workers)
        sys.exit('{}\nfix: check --data {}'.format(str(e).split('\nIn the worker:')[0],
                                                    args.data))
    train_it = data.DevicePrefetcher(train_it, converter, device)
    updater = training.StandardUpdater(train_it, optimizer, converter=train_it.converter,
                                       device=device)

    iters_per_epoch = math.ceil(len(train) / args.batch_size)     # train: this shard
    total = args.iterations or int(args.epochs * iters_per_epoch)
    if total < 1:
        sys.exit('--epochs {}: less than one of the {} iterations an epoch has; give more '
                 'epochs, or --iterations'.format(args.epochs, iters_per_epoch))
    trainer = training.Trainer(updater, (total, 'iteration'), out=args.out)
    schedule = lr_at(args, base_lr, iters_per_epoch, total)

    # The rate of the next update, set after this iteration's other extensions
    # (the log's lr is the rate the logged update used); the first update's is
    # set below, after a resume (the optimizer's lr is not in a snapshot).
    @training.make_extension(trigger=(1, 'iteration'), priority=training.PRIORITY_READER)
    def set_lr(trainer):
        optimizer.lr = schedule(trainer.updater.iteration)

    trainer.extend(set_lr)
    eval_every = (1, 'epoch') if not args.iterations else (total, 'iteration')
    if comm is not None and args.skip_bad_images and not args.iterations:
        # a batch left out whole moves a rank's epoch end: the evaluation's
        # collective calls must come at the same iteration on every rank
        eval_every = (iters_per_epoch, 'iteration')
    evaluator = extensions.Evaluator(val_it, model, converter=converter, device=device)
    if comm is not None:
        evaluator = distributed.create_multi_node_evaluator(evaluator, comm)
    trainer.extend(evaluator, trigger=eval_every)
    skipped_before = None
    if args.skip_bad_images:
        trainer.extend(ValidationSkips(val_it, comm), trigger=eval_every)
        if not args.no_snapshots:
            skipped_before = SkippedBefore({'training': train_it, 'validation': val_it}, comm)
            trainer.extend(skipped_before, trigger=snapshot_trigger(args, iters_per_epoch,
                                                                    total))
    meter = SpeedMeter(args.batch_size)
    trainer.extend(meter)
    if not args.no_snapshots:
        snapshot = extensions.snapshot(filename='snapshot_iter_{.updater.iteration}',
                                       n_retains=args.keep_snapshots or -1)
        if comm is not None:
            # on every rank: each rank's BatchNormalization statistics and
            # loader place go into rank 0's file, and come back to each
            snapshot = distributed.multi_node_snapshot(comm, snapshot)
        trainer.extend(snapshot, trigger=snapshot_trigger(args, iters_per_epoch, total))
    if rank == 0:
        add_reporting(trainer, args, total, iters_per_epoch)
    trainer.extend(RunRecord(record), trigger=lambda trainer: False)
    if args.resume:
        if not os.path.isfile(args.resume):
            sys.exit(missing_snapshot(args.resume))
        recorded = recorded_run(args.resume)
        known = isinstance(recorded, dict)
        changed = changes(recorded, record) if known else []
        fixed = changes(recorded, record, FIXED) if known else []
        config = os.path.join(os.path.dirname(os.path.abspath(args.resume)), 'config.json')
        where = ' (they are in {})'.format(config) if os.path.exists(config) else ''
        # one message, from rank 0: every rank leaves at the same place
        if fixed:
            sys.exit('--resume {}: the run that wrote it had {}: a snapshot holds state of '
                     'that shape, so these cannot change on a resume; resume with the '
                     'processes and the data of that run{}'.format(
                         args.resume, '; '.join(fixed), where) if rank == 0 else 1)
        if changed and not args.resume_with_changes:
            sys.exit('--resume {}: the run that wrote it trained with other settings: {}. '
                     'A resumed run goes on as that run only with the same ones{}: give '
                     'them, or --resume-with-changes to go on with these (the run then '
                     'differs from an uninterrupted one from here on)'.format(
                         args.resume, '; '.join(changed), where) if rank == 0 else 1)
        if rank == 0 and changed:
            print('note: --resume-with-changes: going on from {} with {}'.format(
                args.resume, '; '.join(changed)), file=sys.stderr, flush=True)
        if rank == 0 and recorded is None:
            print('note: {} records no settings (a snapshot of an older recipe): whether '
                  'this run trains as the one that wrote it is not checked'.format(
                      args.resume), file=sys.stderr, flush=True)
        try:
            chainer.serializers.load_npz(args.resume, trainer)     # every rank: same state
        except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, OSError) as e:
            sys.exit('--resume {}: not a snapshot this recipe can read ({}: {}): a file cut '
                     'short (a run stopped while writing it?) or another kind of file. '
                     'Resume from an earlier snapshot_iter_N'.format(
                         args.resume, type(e).__name__, e))
        except (ValueError, KeyError) as e:
            # a model of another shape, or the state of another number of processes
            sys.exit('--resume {}: the snapshot does not fit this run ({}: {}). Resume with '
                     'the options and the number of processes of the run that wrote it{}'
                     .format(args.resume, type(e).__name__, e,
                             ' (its options are in {})'.format(config)
                             if os.path.exists(config) else ''))
        loaded = fp32_masters_into(args.resume, model)
        if loaded and rank == 0:
            print('note: {} was written by an fp16 run: this fp32 run resumes from its {} '
                  'fp32 master weights (not its fp16 copies; its loss scaler is not '
                  'used)'.format(args.resume, loaded), file=sys.stderr, flush=True)
    if updater.iteration >= total:
        sys.exit('--resume {}: the snapshot is at iteration {}, the end of this run ({} '
                 'iterations): give more --iterations or --epochs to train further'.format(
                     args.resume, updater.iteration, total))
    optimizer.lr = schedule(updater.iteration)      # 0, or where the snapshot stopped
    if rank == 0:
        write_config(args, handle, world, 'at the start of training')

    try:
        trainer.run(show_loop_exception_msg=False)   # an error is raised (or named) below
    except data.DataLoadError as e:
        newest = newest_snapshot(args)
        resume = '; then go on from the newest snapshot: --resume {}'.format(newest) \
            if newest else ''
        if args.skip_bad_images:
            sys.exit('{}\nfix: check --data {}: with --skip-bad-images, a whole epoch of '
                     'images failed to load{}'.format(e, args.data, resume))
        sys.exit('{}\nfix: replace or remove that file, or run with --skip-bad-images to '
                 'leave unreadable images out (counted in the log as skipped_examples){}'
                 .format(str(e).split('\nIn the worker:')[0], resume))
    except data.WorkerDiedError as e:
        sys.exit(str(e))
    except KeyboardInterrupt as e:
        if comm is not None:
            raise           # fastchain's hooks end every rank (status 130)
        release_quietly(e.__traceback__)
        newest = newest_snapshot(args)
        print('\ninterrupted at iteration {}{}'.format(
            updater.iteration, '; to go on: --resume {}'.format(newest) if newest else ''),
            file=sys.stderr, flush=True)
        sys.exit(130)
    finally:
        val_it.finalize()
    if args.skip_bad_images:
        write_skipped(args, {'training': train_it, 'validation': val_it}, comm, rank,
                      skipped_before)
    log = trainer.get_extension('LogReport') if rank == 0 else None
    if rank == 0:
        write_config(args, handle, world, 'at the end of training')
        speed_report(args, handle, meter, log, device, n_classes, world)
    handle.disable()        # writes the timeline
    if rank == 0 and args.timeline:
        print(timeline_line(handle, world), flush=True)
    return log.log if log is not None else None


def missing_snapshot(path):
    """The message for a --resume that is no file: a folder's snapshots, or
    the folder's where the file is not there."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    found = snapshots(folder)
    what = 'a folder; give a snapshot file' if os.path.isdir(path) else 'no such file'
    return '--resume {}: {} ({})'.format(
        path, what, 'the newest in {} is {}'.format(folder, os.path.join(folder, found[-1]))
        if found else 'no snapshot_iter_N in {}'.format(folder))


def timeline_line(handle, world):
    """Where --timeline's files went (written at disable())."""
    saved = getattr(handle.resources.get('timeline'), 'saved', None)
    if saved is None:
        return 'timeline: nothing recorded, no files written'
    return ('timeline: {} (Chrome trace: chrome://tracing or ui.perfetto.dev), summary '
            '{}{}{}').format(
        saved['json'], saved['txt'], ', chart {}'.format(saved['png']) if saved['png'] else '',
        '; the other ranks beside them (.rank1, ...)' if world > 1 else '')


def release_quietly(tb):
    """Frees what the interrupted frames of ``tb`` hold, now and silently: an
    interrupt inside a snapshot's writing leaves its ZipFile (of a temporary
    file, removed) to complain when collected at exit ("Exception ignored
    ... seek of closed file")."""
    from fastchain.distributed._faults import _clear_frames
    previous = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        _clear_frames(tb)       # innermost first; main's own frame is still running
        gc.collect()
    finally:
        sys.unraisablehook = previous


def snapshots(folder):
    """The snapshots in ``folder`` (--out), newest last (by time: Chainer keeps
    the newest by time, also those of an earlier run in the same --out)."""
    if not os.path.isdir(folder):
        return []
    return sorted((n for n in os.listdir(folder) if n.startswith('snapshot_iter_')),
                  key=lambda n: os.path.getmtime(os.path.join(folder, n)))


def newest_snapshot(args):
    names = [] if args.no_snapshots else snapshots(args.out)
    return os.path.join(args.out, names[-1]) if names else None


def snapshot_line(args):
    if args.no_snapshots:
        return 'snapshots: none (--no-snapshots)'
    names = snapshots(args.out)
    if not names:
        return 'snapshots: none written'
    size = os.path.getsize(os.path.join(args.out, names[-1]))
    return 'snapshots: {} kept in {} (newest {}, {:.0f} MB; --keep-snapshots {}, ' \
        '--no-snapshots for none)'.format(len(names), args.out, names[-1], size / 1e6,
                                          args.keep_snapshots)


def write_config(args, handle, world, when):
    """``config.json``: the options of this run (command line and --config),
    what was passed to ``fastchain.enable()`` and resolved from it, and each
    accelerator's state as it was in force ``when``."""
    accelerators = handle.report()
    # enable()'s loader is for updaters it builds; the recipe builds its own
    # pipeline and passes loader_workers=0: its state is the pipeline's.
    accelerators['loader'] = dict(loader_state(args), enable_loader=accelerators.get('loader'))
    accelerators.pop('prefetch_to_device', None)
    config = {'args': vars(args), 'processes': world, 'written': when,
              'enable': {'given': {k: handle.options[k] for k in sorted(handle.explicit)
                                   if k != 'loader_workers'},
                         'given_by_the_recipe': {'loader_workers': 0},
                         'resolved': handle.options},
              'accelerators': accelerators}
    with open(os.path.join(args.out, 'config.json'), 'w') as f:
        json.dump(config, f, indent=2, sort_keys=True, default=repr)


def snapshot_trigger(args, iters_per_epoch, total):
    """Every --snapshot-every epochs, and at the last iteration."""
    return LogTrigger(max(1, int(args.snapshot_every * iters_per_epoch)), total)


def add_reporting(trainer, args, total, iters_per_epoch):
    """Logs, plots and progress: rank 0's job."""
    every = LogTrigger(args.log_every, total)
    log = extensions.LogReport(trigger=every)
    trainer.extend(log)
    trainer.extend(extensions.observe_lr(), trigger=every)
    if extensions.PlotReport.available():
        trainer.extend(extensions.PlotReport(
            ['main/loss', 'validation/main/loss'], 'iteration',
            trigger=every, file_name='loss.png'))
        trainer.extend(extensions.PlotReport(
            ['main/accuracy', 'validation/main/accuracy'], 'iteration',
            trigger=every, file_name='accuracy.png'))
    trainer.extend(extensions.PrintReport(
        ['epoch', 'iteration', 'main/loss', 'main/accuracy', 'validation/main/loss',
         'validation/main/accuracy', 'lr', 'elapsed_time']),
        trigger=every)
    if not args.no_progress:
        trainer.extend(extensions.ProgressBar(update_interval=max(1, args.log_every // 2)))


if __name__ == '__main__':
    main()
