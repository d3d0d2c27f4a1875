"""profiling/: the SQLite summariser, the capture window, the timeline tool."""

import os
import sqlite3
import subprocess
import sys

from .conftest import nest
from .test_injection import run

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..')
PROFILING = os.path.join(ROOT, 'profiling')

# The documented export schema (the columns fastchain reads, and the others
# of NVTX_EVENTS, so a query that named a missing column would fail here).
SCHEMA = '''
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL,
    rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER,
    endGlobalTid INTEGER, textId INTEGER REFERENCES StringIds(id), domainId INTEGER,
    uint64Value INTEGER, int64Value INTEGER, doubleValue REAL, uint32Value INTEGER,
    int32Value INTEGER, floatValue REAL, jsonTextId INTEGER, jsonText TEXT);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,
    correlationId INTEGER, globalPid INTEGER, shortName INTEGER NOT NULL);
'''


def to_sqlite(events, path, kernels=()):
    """The recorded NVTX calls as `nsys export --type sqlite` lays them out."""
    db = sqlite3.connect(path)
    db.executescript(SCHEMA)
    domains = {'fastchain': 1, 'other': 2}
    for name, did in domains.items():
        db.execute('INSERT INTO NVTX_EVENTS (start, eventType, text, domainId) '
                   'VALUES (0, 75, ?, ?)', (name, did))
    strings, stacks = {}, {}
    pid = os.getpid()
    for kind, tid, t, domain, category, _, message in events:
        did = domains.get(domain, 0)
        if kind == 'category':
            db.execute('INSERT INTO NVTX_EVENTS (start, eventType, category, text, domainId) '
                       'VALUES (?, 33, ?, ?, ?)', (t, category, message, did))
        elif kind == 'push':
            stacks.setdefault((tid, domain), []).append((t, category, message))
        elif kind == 'pop':
            start, category, message = stacks[(tid, domain)].pop()
            if message not in strings:
                strings[message] = len(strings) + 1
                db.execute('INSERT INTO StringIds VALUES (?, ?)', (strings[message], message))
            db.execute('INSERT INTO NVTX_EVENTS (start, end, eventType, category, textId, '
                       'domainId, globalTid) VALUES (?, ?, 59, ?, ?, ?, ?)',
                       (start, t, category, strings[message], did, (pid << 24) | tid))
    # A range in another domain must not count.
    db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, domainId, globalTid) "
               "VALUES (0, 10, 59, 'step', 2, 1)")
    db.executemany('INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, 7, 0, 0, 1)',
                   kernels)
    db.commit()
    db.close()


def test_summariser_reads_an_nsys_export_of_a_real_run(nvtx_tool, tmp_path):
    events = run(nvtx_tool, tmp_path, poison=())
    path = str(tmp_path / 'report.sqlite')
    roots, _ = nest(events)
    # One kernel covering the first half of every step.
    kernels = [(s['start'], s['start'] + (s['end'] - s['start']) // 2)
               for s in roots if s['name'] == 'step']
    to_sqlite(events, path, kernels)
    out = subprocess.run([sys.executable, os.path.join(PROFILING, 'summarize.py'), path,
                          '--png', str(tmp_path / 'steps.png')],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert 'fastchain step breakdown (3 steps, 1 warm-up left out)' in text
    for phase in ('data', 'convert', 'forward', 'backward', 'loss_scale', 'update',
                  'extension', 'total'):
        assert '\n' + phase in text
    idle = float(text.split('device idle: ')[1].split('%')[0])
    assert 45 < idle < 75     # half of each step, plus the extensions after it
    assert 'diagnosis: ' in text
    assert (tmp_path / 'steps.png').exists()


def test_summariser_explains_a_report_without_fastchain(tmp_path):
    path = str(tmp_path / 'empty.sqlite')
    to_sqlite([], path)
    db = sqlite3.connect(path)
    db.execute("DELETE FROM NVTX_EVENTS WHERE text = 'fastchain'")
    db.commit()
    out = subprocess.run([sys.executable, os.path.join(PROFILING, 'summarize.py'), path],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "no 'fastchain' NVTX domain" in out.stderr


def test_capture_window_spans_the_chosen_iterations(nvtx_tool, tmp_path, monkeypatch):
    monkeypatch.setenv('FASTCHAIN_CAPTURE', '2:3')
    roots, _ = nest(run(nvtx_tool, tmp_path, poison=()))
    capture = [r for r in roots if r['name'] == 'capture']
    assert len(capture) == 1
    assert [c['name'] for c in capture[0]['children']] == [
        'step', '!epoch 1', 'extension LogReport', 'step']
    assert sum(r['name'] == 'step' for r in roots) == 2      # steps 1 and 4 outside


def test_nsys_profile_dry_run_prints_the_commands():
    out = subprocess.run([sys.executable, os.path.join(PROFILING, 'nsys_profile.py'),
                          '--iterations', '100:120', '-o', 'prof/r', '--dry-run', '--',
                          'recipes/resnet50/train.py', '--all'],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    profile, export, summarize = out.stdout.strip().split('\n')
    assert profile.startswith('FASTCHAIN_CAPTURE=100:120 ')
    assert '--capture-range=nvtx' in profile and '--nvtx-capture=capture@fastchain' in profile
    assert 'recipes/resnet50/train.py --all' in profile
    assert 'export --type sqlite' in export and 'prof/r.nsys-rep' in export
    assert 'summarize.py prof/r.sqlite' in summarize


def test_timeline_tool_on_a_recipe_run(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(PROFILING, 'timeline.py'), '-o', str(tmp_path / 'tl'),
         '--', os.path.join(ROOT, 'recipes', 'resnet50', 'train.py'), '--data', 'demo',
         '--demo-root', str(tmp_path / 'demo'), '--demo-per-class', '4',
         '--image-size', '32', '--width', '8', '--batch-size', '8', '--iterations', '5',
         '--out', str(tmp_path / 'out'), '--no-progress'],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert 'fastchain step breakdown (4 steps, 1 warm-up left out)' in out.stdout
    assert 'diagnosis:' in out.stdout
    for ext in ('.json', '.png', '.txt'):
        assert (tmp_path / ('tl' + ext)).exists()
