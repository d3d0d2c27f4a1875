#!/usr/bin/env python
"""Per-phase breakdown of a training step from an Nsight Systems SQLite export.

    nsys export --type sqlite -o report.sqlite report.nsys-rep
    python profiling/summarize.py report.sqlite [--png steps.png] [--skip 1]

Reads the ``fastchain`` domain's push/pop ranges from ``NVTX_EVENTS``
(eventType 59; the domain from its NvtxDomainCreate row, eventType 75;
category names from NvtxCategory rows, eventType 33; registered strings
through ``StringIds``) and, when present, device kernels from
``CUPTI_ACTIVITY_KIND_KERNEL`` to measure how long the device sat idle.
Prints the mean time of each phase of a step, its share, the device's idle
share and a one-line diagnosis.
"""

import argparse
import collections
import os
import sqlite3
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from fastchain.nvtx import _summary  # noqa: E402

NVTX_CATEGORY, NVTX_PUSH_POP, NVTX_DOMAIN_CREATE = 33, 59, 75


def _tables(db):
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def read_ranges(db, domain='fastchain'):
    """fastchain's ranges as summary Ranges (thread = globalTid)."""
    tables = _tables(db)
    if 'NVTX_EVENTS' not in tables:
        raise SystemExit('no NVTX_EVENTS table: was the report taken with --trace=nvtx?')
    row = db.execute('SELECT domainId FROM NVTX_EVENTS WHERE eventType = ? AND text = ?',
                     (NVTX_DOMAIN_CREATE, domain)).fetchone()
    if row is None:
        raise SystemExit('no {!r} NVTX domain in this report: run the training with '
                         'fastchain.enable(nvtx=True) (on by default under nsys)'.format(domain))
    domain_id = row[0]
    strings = dict(db.execute('SELECT id, value FROM StringIds')) \
        if 'StringIds' in tables else {}
    categories = {cid: name for cid, name in db.execute(
        'SELECT category, text FROM NVTX_EVENTS WHERE eventType = ? AND domainId = ?',
        (NVTX_CATEGORY, domain_id))}
    rows = db.execute(
        'SELECT start, end, text, textId, category, globalTid FROM NVTX_EVENTS '
        'WHERE eventType = ? AND domainId = ? AND end IS NOT NULL ORDER BY start',
        (NVTX_PUSH_POP, domain_id)).fetchall()
    by_thread = collections.defaultdict(list)
    for start, end, text, text_id, category, tid in rows:
        name = text if text is not None else strings.get(text_id, '')
        by_thread[tid].append((start, end, name, categories.get(category, '')))
    ranges = []
    for tid, items in by_thread.items():
        items.sort(key=lambda r: (r[0], -r[1]))
        stack = []
        for start, end, name, category in items:
            while stack and stack[-1] <= start:
                stack.pop()
            ranges.append(_summary.Range(name, category, tid, start, end, len(stack)))
            stack.append(end)
    return ranges


def read_kernels(db):
    if 'CUPTI_ACTIVITY_KIND_KERNEL' not in _tables(db):
        return None
    return [tuple(r) for r in db.execute('SELECT start, end FROM CUPTI_ACTIVITY_KIND_KERNEL')]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('sqlite', help='the file written by `nsys export --type sqlite`')
    p.add_argument('--skip', type=int, default=1, help='warm-up steps to leave out')
    p.add_argument('--png', help='also draw the breakdown here')
    args = p.parse_args(argv)
    if not os.path.exists(args.sqlite):
        raise SystemExit('{}: no such file'.format(args.sqlite))
    db = sqlite3.connect('file:{}?mode=ro'.format(args.sqlite), uri=True)
    result = _summary.summarize(read_ranges(db), kernels=read_kernels(db), skip=args.skip)
    print(_summary.format_summary(result))
    if args.png:
        _summary.plot(result, args.png)
        print('chart: ' + args.png)
    return result


if __name__ == '__main__':
    main()
