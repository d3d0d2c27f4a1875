#!/usr/bin/env python
"""Per-phase breakdown of a training step from an Nsight Systems SQLite export.

    nsys export --type sqlite -o report.sqlite report.nsys-rep
    python profiling/summarize.py report.sqlite [--png steps.png] [--skip 1]
    python profiling/summarize.py nvtx_ranges.tsv    # the NVTX injection recorder's log

The second form reads the log of ``tests/nvtx/nvtx_recorder.c`` (an NVTX
tool received through ``NVTX_INJECTION64_PATH`` as nsys is, writing one
tab-separated line per call; ``FASTCHAIN_NVTX_LOG`` names the file): where
``nsys`` cannot report (the GPU node), the same breakdown from the same
calls, host time only (no kernels, so no device idle). A range left open
(a run cut off) is left out. The recorder appends and writes no process id:
give it a fresh file per run (gpu_check.py removes the old one).

Reads the ``fastchain`` domain's push/pop ranges from ``NVTX_EVENTS``
(eventType 59; the domain from its NvtxDomainCreate row, eventType 75;
category names from NvtxCategory rows, eventType 33; registered strings
through ``StringIds``) and, when present, device kernels from
``CUPTI_ACTIVITY_KIND_KERNEL`` (with the copies and memsets of
``CUPTI_ACTIVITY_KIND_MEMCPY`` and ``_MEMSET``) to measure how long the
device sat idle;
NCCL's kernels among them (short name ``nccl...``) give the allreduce time on
the device per step, each counted in the step that launched it (its launch
call's start in ``CUPTI_ACTIVITY_KIND_RUNTIME``, matched by correlationId;
the kernel's own start where that table is missing).
Prints the median time of each phase of a step, its share, the one-off
events (a snapshot, an evaluation: see ``fastchain/nvtx/_summary.py``) by
name and duration, the device's idle share and a one-line diagnosis.

An export of several processes (a data-parallel job under one ``nsys
profile``) gets a breakdown a process, from its own ranges and kernels.

Exit status 2, with one line on stderr, for a file that is missing, is not
the SQLite export of an nsys report of a fastchain run, or holds no closed
'step' range.
"""

import argparse
import collections
import os
import pathlib
import sqlite3
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from fastchain.nvtx import _chart, _summary  # noqa: E402

NVTX_CATEGORY, NVTX_PUSH_POP, NVTX_DOMAIN_CREATE = 33, 59, 75
EXPECTED = ('expected the SQLite export of an Nsight Systems report; make one with '
            '`nsys export --type sqlite -o report.sqlite report.nsys-rep`')
SQLITE_MAGIC = b'SQLite format 3\x00'
RECORDER_KINDS = ('category', 'push', 'pop', 'mark', 'start', 'end')


class ReportError(Exception):
    """The file is not a usable nsys SQLite export of a fastchain run."""


def _tables(db):
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def check_file(path):
    """Raise :class:`ReportError` unless ``path`` is an SQLite file."""
    if not os.path.exists(path):
        raise ReportError('no such file ({})'.format(EXPECTED))
    if os.path.isdir(path):
        raise ReportError('a folder, not a file ({})'.format(EXPECTED))
    try:
        with open(path, 'rb') as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as e:
        raise ReportError('cannot be read: {}'.format(e.strerror or e))
    if head != SQLITE_MAGIC:
        if path.endswith(('.nsys-rep', '.qdrep')):
            raise ReportError('an Nsight Systems report, not its SQLite export: run '
                              '`nsys export --type sqlite -o {}.sqlite {}` and pass the '
                              '.sqlite file'.format(os.path.splitext(path)[0], path))
        raise ReportError('{} ({})'.format(
            'an empty file' if not head else 'not an SQLite file', EXPECTED))


def process_of(global_tid):
    """The process part of an nsys ``globalTid``/``globalPid`` (its bits above
    the thread id's 24), None where the row has none."""
    return None if global_tid is None else global_tid >> 24


def pid_of(process):
    """The operating system's process id within :func:`process_of`'s key."""
    return process & 0xFFFFFF


def read_ranges(db, domain='fastchain'):
    """fastchain's closed push/pop ranges as summary Ranges (thread =
    globalTid), and notes on what the export lacked.

    An export of several processes (``nsys profile mpiexec ...``) holds each
    process's domain under its own id: the domain and its categories are
    matched per process (a row with no globalTid stands for every process).
    Where the category names are missing (they are registered at the first
    range of each, before a capture window opens), each range's category is
    found from its name, as fastchain names them."""
    tables = _tables(db)
    if 'NVTX_EVENTS' not in tables:
        raise ReportError('no NVTX_EVENTS table: not an nsys export, or the report was '
                          'taken without --trace=nvtx ({})'.format(EXPECTED))
    domains = {(did, process_of(tid)) for did, tid in db.execute(
        'SELECT domainId, globalTid FROM NVTX_EVENTS WHERE eventType = ? AND text = ?',
        (NVTX_DOMAIN_CREATE, domain))}
    if not domains:
        raise ReportError('no {!r} NVTX domain in this report: run the training with '
                          'fastchain.enable(nvtx=True) (on by default under nsys)'
                          .format(domain))

    def ours(did, tid):
        return (did, process_of(tid)) in domains or (did, None) in domains

    strings = dict(db.execute('SELECT id, value FROM StringIds')) \
        if 'StringIds' in tables else {}
    categories = {}
    for cid, name, did, tid in db.execute(
            'SELECT category, text, domainId, globalTid FROM NVTX_EVENTS WHERE eventType = ?',
            (NVTX_CATEGORY,)):
        if ours(did, tid):
            categories[(did, process_of(tid), cid)] = name
    rows = db.execute(
        'SELECT start, end, text, textId, category, globalTid, domainId FROM NVTX_EVENTS '
        'WHERE eventType = ? AND end IS NOT NULL ORDER BY start',
        (NVTX_PUSH_POP,)).fetchall()
    by_thread = collections.defaultdict(list)
    unnamed = 0
    for start, end, text, text_id, category, tid, did in rows:
        if not ours(did, tid):
            continue
        name = text if text is not None else strings.get(text_id, '')
        found = categories.get((did, process_of(tid), category),
                               categories.get((did, None, category)))
        if found is None:
            unnamed += 1
            found = _summary.category_from_name(name)
        by_thread[tid].append((start, end, name, found))
    ranges = []
    for tid, items in by_thread.items():
        items.sort(key=lambda r: (r[0], -r[1]))
        stack = []
        for start, end, name, category in items:
            while stack and stack[-1] <= start:
                stack.pop()
            ranges.append(_summary.Range(name, category, tid, start, end, len(stack)))
            stack.append(end)
    notes = []
    if unnamed:
        notes.append('note: {} of the {} fastchain ranges have a category this report does '
                     'not name (no NvtxCategory row for it): their categories were taken '
                     'from their names, as fastchain names its ranges'.format(
                         unnamed, sum(len(v) for v in by_thread.values())))
    return ranges, notes


def is_recorder_log(path):
    """Whether ``path`` starts as the injection recorder's log does."""
    try:
        with open(path, 'rb') as f:
            head = f.read(256)
    except OSError:
        return False
    kind, tab, rest = head.partition(b'\t')
    return bool(tab) and kind.decode('ascii', 'replace') in RECORDER_KINDS and \
        rest.count(b'\t') >= 5


def recorder_events(path):
    """The recorder's lines as (kind, thread, time_ns, domain, category,
    extra, message); a last line cut off mid-write is left out."""
    events = []
    with open(path, errors='replace') as f:
        for n, line in enumerate(f, 1):
            try:
                kind, tid, t, dom, category, extra, message = line.rstrip('\n').split('\t', 6)
                events.append((kind, int(tid), int(t), dom, int(category), int(extra), message))
            except ValueError:
                if not line.endswith('\n'):
                    break               # the last line of a run cut off mid-write
                raise ReportError('line {}: not a line of the NVTX recorder (kind, thread, '
                                  'time, domain, category, extra, message, tab-separated)'
                                  .format(n))
    return events


def read_recorder_log(path, domain='fastchain'):
    """fastchain's push/pop ranges from the recorder's log as summary Ranges
    (thread = the recorder's thread id; ranges still open at the end left
    out)."""
    categories, stacks, ranges = {}, collections.defaultdict(list), []
    for kind, tid, t, dom, category, _, message in recorder_events(path):
        if dom != domain:
            continue
        if kind == 'category':
            categories[category] = message
        elif kind == 'push':
            stacks[tid].append((t, message, category))
        elif kind == 'pop' and stacks[tid]:
            start, name, category = stacks[tid].pop()
            ranges.append(_summary.Range(name, categories.get(category, ''), tid, start, t,
                                         len(stacks[tid])))
    if not ranges:
        raise ReportError('no closed {!r} range in this recorder log: run the training with '
                          'fastchain.enable(nvtx=True) and the recorder attached'
                          .format(domain))
    return ranges


DEVICE_WORK = ('CUPTI_ACTIVITY_KIND_KERNEL', 'CUPTI_ACTIVITY_KIND_MEMCPY',
               'CUPTI_ACTIVITY_KIND_MEMSET')


def read_kernels(db, process=None):
    """(start, end) of the device's work: its kernels, copies and memsets (of
    ``process``, a :func:`process_of` key, where given); None where the
    export has none, or where it cannot say which process did them."""
    tables = [t for t in DEVICE_WORK if t in _tables(db)]
    if 'CUPTI_ACTIVITY_KIND_KERNEL' not in tables:
        return None
    work = []
    for table in tables:
        if process is None:
            work += db.execute('SELECT start, end FROM {}'.format(table))
        elif 'globalPid' in _columns(db, table):
            work += db.execute('SELECT start, end FROM {} WHERE (globalPid >> 24) = ?'
                               .format(table), (process,))
        elif table == 'CUPTI_ACTIVITY_KIND_KERNEL':
            return None
    return [tuple(r) for r in work]


def _columns(db, table):
    return {r[1] for r in db.execute('PRAGMA table_info({})'.format(table))}


def read_device(db, process=None):
    """NCCL's kernels (of ``process``, where given) as summary DeviceRanges
    (category 'allreduce'), or None."""
    tables = _tables(db)
    if 'CUPTI_ACTIVITY_KIND_KERNEL' not in tables or 'StringIds' not in tables:
        return None
    kernel = _columns(db, 'CUPTI_ACTIVITY_KIND_KERNEL')
    if not {'shortName', 'correlationId'} <= kernel:
        return None
    if process is not None and 'globalPid' not in kernel:
        return None
    launch = 'k.start'
    join = ''
    if 'CUPTI_ACTIVITY_KIND_RUNTIME' in tables and \
            'correlationId' in _columns(db, 'CUPTI_ACTIVITY_KIND_RUNTIME'):
        launch = 'COALESCE(r.start, k.start)'
        join = ('LEFT JOIN CUPTI_ACTIVITY_KIND_RUNTIME AS r ON r.correlationId = '
                'k.correlationId')
        if 'globalPid' in kernel and 'globalTid' in _columns(db, 'CUPTI_ACTIVITY_KIND_RUNTIME'):
            # Correlation ids are per process: a report of several ranks repeats them.
            join += ' AND (r.globalTid >> 24) = (k.globalPid >> 24)'
    where, params = "s.value LIKE 'nccl%'", ()
    if process is not None:
        where, params = where + ' AND (k.globalPid >> 24) = ?', (process,)
    rows = db.execute(
        'SELECT s.value, k.deviceId, k.streamId, k.start, k.end, {} '
        'FROM CUPTI_ACTIVITY_KIND_KERNEL AS k JOIN StringIds AS s ON s.id = k.shortName {} '
        'WHERE {} ORDER BY k.start'.format(launch, join, where), params).fetchall()
    return [_summary.DeviceRange(name, 'allreduce', 'GPU {} stream {}'.format(dev, stream),
                                 start, end, launched)
            for name, dev, stream, start, end, launched in rows]


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        epilog='An export of several processes (a data-parallel job profiled whole, '
               '`nsys profile mpiexec -n 2 ...`) gets a breakdown a process, each from its '
               "own ranges and kernels. Exit status: 0, or 2 for a usage error or a file "
               'that is not an nsys SQLite export of a fastchain run with a training step '
               'in it (one line on stderr says why).')
    p.add_argument('sqlite', help='the file written by `nsys export --type sqlite` (or the '
                                  "NVTX injection recorder's log)")
    p.add_argument('--skip', type=int, default=1, help='warm-up steps to leave out')
    p.add_argument('--png', help='also draw the breakdown here (a .png path; with several '
                                 'processes, one a process: PATH.pidN.png)')
    p.add_argument('--process', type=int, metavar='PID',
                   help='only this process of an export of several (its process id)')
    args = p.parse_args(argv)
    if args.skip < 0:
        p.error('--skip {}: give how many leading steps to leave out, 0 or more'.format(
            args.skip))
    if args.png is not None:
        folder = os.path.dirname(os.path.abspath(args.png))
        if not args.png.lower().endswith('.png'):
            p.error('--png {}: give a path ending in .png'.format(args.png))
        if not os.path.isdir(folder):
            p.error('--png {}: the folder {} does not exist'.format(args.png, folder))
    try:
        parts, notes = _load(args)
        results = [(process, _summary.summarize(ranges, kernels=kernels, skip=args.skip,
                                                device=device or None))
                   for process, ranges, kernels, device in parts]
        if not any(r['steps'] for _, r in results):
            raise ReportError(NO_STEP)
    except ReportError as e:
        _fail('{}: {}'.format(args.sqlite, e))
    except sqlite3.DatabaseError as e:
        _fail('{}: unreadable as SQLite: {} ({})'.format(args.sqlite, e, EXPECTED))
    for line in notes:
        print(line)
    names = labels([process for process, _ in results])
    for n, (process, result) in enumerate(results, 1):
        png = args.png
        if len(results) > 1:
            print('{}== process {} ({} of {}) =='.format('\n' if n > 1 else '',
                                                       names[process], n, len(results)))
            png = png and '{}.pid{}.png'.format(png[:-4], names[process])
        _report(args, result, png)
    return results[0][1] if len(results) == 1 else \
        {names[process]: result for process, result in results}


def labels(processes):
    """{process: its process id}, or 'pid-machine' for ids two machines share
    (nsys's globalPid holds a machine's id above the process's)."""
    pids = [pid_of(p) for p in processes if p is not None]
    return {p: ('-' if p is None else str(pid_of(p)) if pids.count(pid_of(p)) == 1
                else '{}-{}'.format(pid_of(p), p >> 24))
            for p in processes}


NO_STEP = ("no closed 'step' range: fastchain times the update() of Chainer's "
           'StandardUpdaters (a Trainer, or updater.update() in a loop), and none ended in '
           "this record (a script's own loop gets forward, backward and update ranges but no "
           'steps; a run cut off in its first step, or a capture window that closed on no '
           'step, leaves none)')


def _load(args):
    """([(process, ranges, kernels, device)], notes): a part a process that
    has fastchain's ranges (``--process``: that one only)."""
    if is_recorder_log(args.sqlite):
        return [(None, read_recorder_log(args.sqlite), None, None)], []
    check_file(args.sqlite)
    path = pathlib.Path(args.sqlite).resolve().as_uri() + '?mode=ro'
    db = sqlite3.connect(path, uri=True)
    try:
        ranges, notes = read_ranges(db)
        by_process = collections.defaultdict(list)
        for r in ranges:
            by_process[process_of(r.thread)].append(r)
        processes = sorted(by_process, key=lambda p: (p is None, p))
        if args.process is not None:
            chosen = [p for p in processes if p is not None and pid_of(p) == args.process]
            if not chosen:
                raise ReportError('--process {}: no fastchain range of that process here; '
                                  'the processes with some: {}'.format(
                                      args.process, ', '.join(
                                          str(pid_of(p)) for p in processes if p is not None)
                                      or 'none that says its id'))
            processes = chosen
        several = len(by_process) > 1
        has_kernels = 'CUPTI_ACTIVITY_KIND_KERNEL' in _tables(db)
        says_whose = has_kernels and 'globalPid' in _columns(db, 'CUPTI_ACTIVITY_KIND_KERNEL')
        parts = []
        for process in processes:
            # A process's own kernels where the export says whose they are;
            # where it does not, all of them for a process alone, none for
            # one of several.
            key = process if says_whose or several else None
            parts.append((process, by_process[process], read_kernels(db, key),
                          read_device(db, key)))
        if several and has_kernels and not says_whose:
            notes.append("note: the export's kernels do not say which process ran them "
                         '(no globalPid): no device-idle figure a process')
        return parts, notes
    finally:
        db.close()


def _report(args, result, png):
    note = _summary.skip_note(args.skip, result)
    print(_summary.format_summary(result) + ('\n' + note if note else ''))
    if png:
        drawn = _chart.plot(result, png)
        print('chart: ' + (drawn or 'not drawn (no step recorded, or matplotlib missing)'))
    return result


def _fail(message):
    """One line on stderr and exit status 2: no traceback for a wrong file."""
    print('summarize.py: error: ' + message, file=sys.stderr)
    raise SystemExit(2)

if __name__ == '__main__':
    main()
