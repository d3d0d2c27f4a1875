"""profiling/: the SQLite summariser, the capture window, the timeline tool."""

import os
import re
import sqlite3
import statistics
import subprocess
import sys

import pytest

from .conftest import nest, read_log
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
    add_process(db, events, os.getpid(), kernels)
    db.commit()
    db.close()


def add_process(db, events, pid, kernels=(), ids=None, shift=0, categories=True,
                process_rows=False):
    """One process's calls into an export: ``ids`` its domains' ids (nsys
    numbers them per process), times moved by ``shift`` ns; ``categories``
    False leaves out the category names; ``process_rows`` gives the domain
    and category rows the process's globalTid (else none, as for every
    process)."""
    ids = ids or {'fastchain': 1, 'other': 2}
    own = (pid << 24) | 1 if process_rows else None
    strings = dict(db.execute('SELECT value, id FROM StringIds'))

    def string(message):
        if message not in strings:
            strings[message] = len(strings) + 1
            db.execute('INSERT INTO StringIds VALUES (?, ?)', (strings[message], message))
        return strings[message]
    for name, did in ids.items():
        db.execute('INSERT INTO NVTX_EVENTS (start, eventType, text, domainId, globalTid) '
                   'VALUES (0, 75, ?, ?, ?)', (name, did, own))
    stacks = {}
    for kind, tid, t, domain, category, _, message in events:
        did = ids.get(domain, 0)
        t += shift
        if kind == 'category' and categories:
            db.execute('INSERT INTO NVTX_EVENTS (start, eventType, category, text, domainId, '
                       'globalTid) VALUES (?, 33, ?, ?, ?, ?)', (t, category, message, did, own))
        elif kind == 'push':
            stacks.setdefault((tid, domain), []).append((t, category, message))
        elif kind == 'pop':
            start, category, message = stacks[(tid, domain)].pop()
            db.execute('INSERT INTO NVTX_EVENTS (start, end, eventType, category, textId, '
                       'domainId, globalTid) VALUES (?, ?, 59, ?, ?, ?, ?)',
                       (start, t, category, string(message), did, (pid << 24) | tid))
    # A range in another domain must not count.
    db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, domainId, globalTid) "
               "VALUES (?, ?, 59, 'step', ?, ?)", (shift, shift + 10, ids['other'],
                                                   (pid << 24) | 1))
    db.executemany('INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, 7, 0, ?, 1)',
                   [(k0 + shift, k1 + shift, pid << 24) for k0, k1 in kernels])


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
    # Half of each step, plus the extensions after it (their share depends on
    # the machine's load: 80% under a busy CI run), computed here from the
    # ranges themselves: the median over the steps after the warm-up.
    steps = [i for i, r in enumerate(roots) if r['name'] == 'step']
    expected = []
    for n, i in enumerate(steps[1:], 1):
        step = roots[i]
        following = roots[i + 1:steps[n + 1]] if n + 1 < len(steps) else roots[i + 1:]
        end = max([step['end']] + [r['end'] for r in following if 'end' in r])
        expected.append(1 - ((step['end'] - step['start']) // 2) / (end - step['start']))
    assert abs(idle - 100 * statistics.median(expected)) < 0.06, (idle, expected)
    assert idle >= 49.9
    assert 'diagnosis: ' in text
    assert (tmp_path / 'steps.png').exists()


def test_summariser_reads_the_recorders_log_as_it_reads_the_export(nvtx_tool, tmp_path):
    """Where nsys cannot report (the GPU node), the injection recorder's log
    gives the breakdown the export path gives for the same calls (laid out
    as nsys's SQLite export is, by to_sqlite)."""
    run(nvtx_tool, tmp_path, poison=())
    log = str(tmp_path / 'nvtx.log')
    export = str(tmp_path / 'report.sqlite')
    to_sqlite(read_log(log), export)
    with open(log, 'a') as f:            # a run cut off mid-write: the last line half there
        f.write('push\t1\t12')
    outs = [subprocess.run([sys.executable, os.path.join(PROFILING, 'summarize.py'), path],
                           capture_output=True, text=True, timeout=120) for path in (log, export)]
    assert [o.returncode for o in outs] == [0, 0], [o.stderr for o in outs]
    assert 'fastchain step breakdown (3 steps, 1 warm-up left out)' in outs[0].stdout
    assert outs[0].stdout == outs[1].stdout


def test_summariser_refuses_a_recorder_log_without_a_closed_range(tmp_path):
    path = tmp_path / 'cut.tsv'
    path.write_text('category\t7\t100\tfastchain\t1\t0\tstep\n'
                    'push\t7\t110\tfastchain\t1\t0\tstep\n')
    out = subprocess.run([sys.executable, os.path.join(PROFILING, 'summarize.py'), str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no closed 'fastchain' range" in out.stderr
    assert 'Traceback' not in out.stderr


def test_summariser_explains_a_report_without_fastchain(tmp_path):
    path = str(tmp_path / 'empty.sqlite')
    to_sqlite([], path)
    db = sqlite3.connect(path)
    db.execute("DELETE FROM NVTX_EVENTS WHERE text = 'fastchain'")
    db.commit()
    out = subprocess.run([sys.executable, os.path.join(PROFILING, 'summarize.py'), path],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no 'fastchain' NVTX domain" in out.stderr
    assert 'Traceback' not in out.stderr


def _not_an_export(tmp_path, kind):
    if kind == 'missing':
        return str(tmp_path / 'missing.sqlite')
    if kind == 'text':
        path = tmp_path / 'notes.txt'
        path.write_text('not a database\n')
    elif kind == 'empty':
        path = tmp_path / 'empty.sqlite'
        path.write_bytes(b'')
    elif kind == 'report':
        path = tmp_path / 'run.nsys-rep'
        path.write_bytes(b'\x00' * 64)
    else:                           # SQLite, but not an nsys export
        path = tmp_path / 'other.sqlite'
        db = sqlite3.connect(str(path))
        db.execute('CREATE TABLE t (x)')
        db.commit()
        db.close()
    return str(path)


@pytest.mark.parametrize('kind', ['missing', 'text', 'empty', 'report', 'sqlite'])
def test_summariser_refuses_what_is_not_an_export_in_one_line(tmp_path, kind):
    path = _not_an_export(tmp_path, kind)
    out = subprocess.run([sys.executable, os.path.join(PROFILING, 'summarize.py'), path],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert 'Traceback' not in out.stderr and out.stderr.count('\n') == 1, out.stderr
    assert out.stderr.startswith('summarize.py: error: {}: '.format(path))
    assert 'nsys export --type sqlite' in out.stderr       # how to make the right file
    assert out.stdout == ''


@pytest.mark.parametrize('tool', ['nsys_profile.py', 'timeline.py', 'summarize.py'])
def test_profiling_tools_print_help(tool):
    out = subprocess.run([sys.executable, os.path.join(PROFILING, tool), '--help'],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith('usage: ' + tool)
    assert '-h, --help' in out.stdout and out.stderr == ''
    if tool != 'summarize.py':
        assert 'script.py [script args ...]' in out.stdout.split('\n')[0]


def test_nsys_profile_forwards_the_script_args_with_or_without_a_separator():
    base = [sys.executable, os.path.join(PROFILING, 'nsys_profile.py'), '--dry-run']
    for args in (['s.py', '--help', '-o', 'x'], ['--', 's.py', '--help', '-o', 'x']):
        out = subprocess.run(base + args, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        profile = out.stdout.split('\n')[0]
        assert profile.endswith(' s.py --help -o x') and '-o fastchain_profile ' in profile
    out = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and 'give the training script' in out.stderr


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


# A plain Chainer script: strict about its flags (it has no --timeline), with
# an extension that runs once, at iteration 5, and sleeps.
SCRIPT = '''
import argparse
import sys
import time

import numpy
import chainer
import chainer.links as L
from chainer import training


def sleep_once(trainer):
    time.sleep(0.4)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--iterations', type=int, required=True)
    p.add_argument('--out', required=True)
    p.add_argument('--fail', action='store_true')
    p.add_argument('--data-parallel', action='store_true')
    args = p.parse_args()
    x = numpy.random.RandomState(0).randn(64, 4).astype(numpy.float32)
    t = (x[:, 0] > 0).astype(numpy.int32)
    if args.data_parallel:          # as recipes/mnist: lazily shaped, one MPI rank
        from fastchain import distributed
        model = L.Classifier(L.Linear(None, 2))
        opt = distributed.create_multi_node_optimizer(
            chainer.optimizers.SGD(0.1), distributed.create_communicator('mpi'))
        opt.setup(model)
    else:
        model = L.Classifier(L.Linear(4, 2))
        opt = chainer.optimizers.SGD(0.1).setup(model)
    it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(x, t), 8)
    trainer = training.Trainer(training.StandardUpdater(it, opt),
                               (args.iterations, 'iteration'), out=args.out)
    trainer.extend(sleep_once, trigger=(5, 'iteration'))
    trainer.run()
    if args.fail:
        sys.exit(3)


if __name__ == '__main__':
    main()
'''


def run_timeline(tmp_path, *script_args):
    script = tmp_path / 'train_tiny.py'
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, os.path.join(PROFILING, 'timeline.py'), '-o', str(tmp_path / 'tl'),
         str(script), '--iterations', '8', '--out', str(tmp_path / 'out')] + list(script_args),
        capture_output=True, text=True, timeout=300, cwd=str(tmp_path))


def test_timeline_tool_runs_a_plain_script_that_has_no_timeline_flag(tmp_path):
    out = run_timeline(tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert 'fastchain step breakdown (7 steps, 1 warm-up left out)' in out.stdout
    for ext in ('.json', '.png', '.txt'):
        assert (tmp_path / ('tl' + ext)).exists()
    assert out.stdout.startswith(open(str(tmp_path / 'tl.txt')).read())
    # The one-off extension is named with its duration; the diagnosis ignores it.
    found = re.search(r'extension sleep_once: ([0-9.]+) ms in step 5', out.stdout)
    assert found and float(found.group(1)) >= 400, out.stdout
    assert 'diagnosis: extension-bound' not in out.stdout
    assert 'never closed' not in out.stdout


def test_timeline_tool_passes_on_the_script_exit_status_and_still_writes(tmp_path):
    out = run_timeline(tmp_path, '--fail')
    assert out.returncode == 3
    assert 'the script exited with status 3' in out.stderr
    assert (tmp_path / 'tl.txt').exists() and 'step breakdown' in out.stdout


def test_timeline_of_a_lazily_shaped_data_parallel_script_is_balanced(tmp_path):
    # The data-parallel optimizer's first update of a lazily shaped model runs
    # the annotated loss once without backward, then update() again: no range
    # may be left open (it was: every later range nested 2 levels too deep).
    out = run_timeline(tmp_path, '--data-parallel')
    assert out.returncode == 0, out.stderr[-3000:]
    assert 'never closed' not in out.stdout, out.stdout
    assert 'fastchain step breakdown (7 steps, 1 warm-up left out)' in out.stdout


def test_timeline_tool_takes_an_output_with_an_extension_and_refuses_an_unusable_one(tmp_path):
    script = tmp_path / 'noop.py'
    script.write_text('print("ran")\n')
    tool = [sys.executable, os.path.join(PROFILING, 'timeline.py')]
    out = subprocess.run(tool + ['-o', str(tmp_path / 'prof' / 't.json'), str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / 'prof' / 't.json').exists()          # not t.json.json
    assert not (tmp_path / 'prof' / 't.json.json').exists()
    out = subprocess.run(tool + ['-o', '/proc/nope/x', str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and 'ran' not in out.stdout
    assert "-o /proc/nope/x: cannot create the folder /proc/nope" in out.stderr, out.stderr
    assert 'Traceback' not in out.stderr
    # a folder given as -o wrote hidden '.json' files, or a traceback where
    # the folder did not exist (a new-user trial)
    for folder in (str(tmp_path / 'exists') + os.sep, str(tmp_path / 'new') + os.sep):
        os.makedirs(str(tmp_path / 'exists'), exist_ok=True)
        out = subprocess.run(tool + ['-o', folder, str(script)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2 and 'a folder; give the files\' path without extension, ' \
            'e.g. -o {}'.format(os.path.join(folder, 'timeline')) in out.stderr, out.stderr
        assert 'Traceback' not in out.stderr


OWN_TIMELINE = '''
import sys, warnings
import numpy, chainer, chainer.links as L
import fastchain
warnings.simplefilter('ignore')
if sys.argv[2:] == ['exit']:
    sys.exit('bad config')
handle = fastchain.enable(timeline=sys.argv[1], loader_workers=0)
x = numpy.random.RandomState(0).randn(16, 4).astype(numpy.float32)
it = chainer.iterators.SerialIterator(
    chainer.datasets.TupleDataset(x, (x[:, 0] > 0).astype(numpy.int32)), 4)
opt = chainer.optimizers.SGD(0.1).setup(L.Classifier(L.Linear(4, 2)))
updater = chainer.training.StandardUpdater(it, opt)
for _ in range(4):
    updater.update()
handle.disable()
'''


def test_timeline_tool_names_a_scripts_own_timeline_and_a_script_ending_early(tmp_path):
    # a new-user trial: a script with its own enable(timeline=...) took the
    # ranges, and the tool asked whether it trained through an updater; a
    # script ending on a bad config got the same question
    script = tmp_path / 'own.py'
    script.write_text(OWN_TIMELINE)
    tool = [sys.executable, os.path.join(PROFILING, 'timeline.py'), '-o', str(tmp_path / 'tl')]
    own = str(tmp_path / 'own.json')
    out = subprocess.run(tool + [str(script), own], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert 'the script records its own timeline ({})'.format(own) in out.stderr
    assert 'does the script train through one' not in out.stderr
    assert '(3 steps, 1 warm-up left out)' in (tmp_path / 'own.txt').read_text()
    out = subprocess.run(tool + [str(script), own, 'exit'], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert 'the script ended (status 1) before a training step was recorded' in out.stderr
    assert 'does the script train through one' not in out.stderr


def test_summariser_skip_and_png_are_checked_and_a_skip_too_long_said(tmp_path):
    from fastchain.nvtx import _summary
    from tests.nvtx.test_timeline import steps
    tool = [sys.executable, os.path.join(PROFILING, 'summarize.py'), 'any.sqlite']
    for extra, said in ((['--skip', '-3'], '--skip -3: give how many leading steps'),
                        (['--png', 'out.json'], '--png out.json: give a path ending in .png'),
                        (['--png', str(tmp_path / 'no' / 'x.png')], 'does not exist')):
        out = subprocess.run(tool + extra, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and said in out.stderr and 'Traceback' not in out.stderr
    result = _summary.summarize(steps(4, [('forward', 10)]), skip=20)
    assert result['skipped_steps'] == 0 and result['steps'] == 4
    assert _summary.skip_note(20, result) == (
        'warm-up: --skip 20 asks for more steps than the 4 recorded: none left out')
    assert _summary.skip_note(1, _summary.summarize(steps(4, [('forward', 10)]))) is None
    assert 'warm-up: --skip' not in _summary.format_summary(_summary.summarize([]))


def test_nsys_profile_without_nsys_or_the_script_is_a_usage_error_naming_it(tmp_path):
    script = tmp_path / 'train.py'
    script.write_text('print("ran")\n')
    tool = [sys.executable, os.path.join(PROFILING, 'nsys_profile.py')]
    missing = str(tmp_path / 'bin' / 'nsys')
    out = subprocess.run(tool + ['--nsys', missing, str(script)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and '{}: nsys not found'.format(missing) in out.stderr
    assert 'profiling/timeline.py' in out.stderr and 'ran' not in out.stdout
    out = subprocess.run(tool + [str(tmp_path / 'nope.py')], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and 'nope.py: no such script' in out.stderr


def summarize_file(path, *args):
    return subprocess.run([sys.executable, os.path.join(PROFILING, 'summarize.py'), str(path)]
                          + list(args), capture_output=True, text=True, timeout=120)


def export(path, processes):
    """An export of several processes: [(events, pid, kwargs of add_process)]."""
    db = sqlite3.connect(str(path))
    db.executescript(SCHEMA)
    for events, pid, kwargs in processes:
        add_process(db, events, pid, **kwargs)
    db.commit()
    db.close()
    return path


def test_summariser_gives_each_process_of_a_data_parallel_export_its_own_breakdown(
        nvtx_tool, tmp_path):
    """`nsys profile mpiexec -n 2 ...` records both ranks in one export: each
    process's steps, extensions and kernels are its own (they were mixed: an
    extension cut off by the other rank's next step, the other rank's kernels
    filling this one's idle time), and nsys numbers the domains per process
    (id 1 is another domain in the second)."""
    events = run(nvtx_tool, tmp_path, poison=())
    roots, _ = nest(events)
    windows = [(s['start'], s['end']) for s in roots if s['name'] == 'step']
    half = [(a, a + (b - a) // 2) for a, b in windows]
    first = (events, 1000, dict(kernels=half, process_rows=True))
    second = (events, 2000, dict(kernels=windows, shift=300_000, process_rows=True,
                                 ids={'other': 1, 'fastchain': 3}))
    both = summarize_file(export(tmp_path / 'both.sqlite', [first, second]))
    alone = [summarize_file(export(tmp_path / 'p{}.sqlite'.format(p[1]), [p]))
             for p in (first, second)]
    assert [o.returncode for o in [both] + alone] == [0, 0, 0], both.stderr
    sections = both.stdout.split('== process ')[1:]
    assert [s.split('\n', 1)[0] for s in sections] == ['1000 (1 of 2) ==', '2000 (2 of 2) ==']
    for section, own in zip(sections, alone):
        assert section.split('\n', 1)[1].strip() == own.stdout.strip()
    idle = [float(o.stdout.split('device idle: ')[1].split('%')[0]) for o in alone]
    # (the second's kernels cover its steps: only its extensions leave it idle)
    assert idle[0] >= 49.9 and idle[1] < idle[0] - 20, idle
    one = summarize_file(tmp_path / 'both.sqlite', '--process', '2000')
    assert one.returncode == 0 and one.stdout == alone[1].stdout
    wrong = summarize_file(tmp_path / 'both.sqlite', '--process', '7')
    assert wrong.returncode == 2 and 'Traceback' not in wrong.stderr
    assert 'the processes with some: 1000, 2000' in wrong.stderr


def test_summariser_takes_the_categories_from_the_names_where_the_export_lacks_them(
        nvtx_tool, tmp_path):
    """A category is named once, at its first range: an export without those
    rows (a capture window opened later) read as 'no training step'."""
    events = run(nvtx_tool, tmp_path, poison=())
    named = summarize_file(export(tmp_path / 'named.sqlite', [(events, 5, {})]))
    unnamed = summarize_file(export(tmp_path / 'unnamed.sqlite',
                                    [(events, 5, dict(categories=False))]))
    assert named.returncode == unnamed.returncode == 0, unnamed.stderr
    note, rest = unnamed.stdout.split('\n', 1)
    assert note.startswith('note: ') and 'taken from their names' in note
    assert rest == named.stdout and '(3 steps, 1 warm-up left out)' in rest


def test_summariser_refuses_a_record_without_a_closed_step(nvtx_tool, tmp_path):
    """A script's own loop (no updater), a run cut off in its first step:
    exit status 2 saying why, from the export as from the recorder's log
    (the export said 'no training step was recorded' with status 0)."""
    events = run(nvtx_tool, tmp_path, poison=())
    # every 'step' range's push and pop left out
    kept, stack = [], []
    for e in events:
        if e[0] == 'push':
            stack.append(e[6])
            if e[6] == 'step':
                continue
        elif e[0] == 'pop':
            if stack.pop() == 'step':
                continue
        kept.append(e)
    assert len(kept) < len(events)
    path = export(tmp_path / 'nostep.sqlite', [(kept, 5, {})])
    log = tmp_path / 'nostep.tsv'
    log.write_text(''.join('\t'.join(str(v) for v in e) + '\n' for e in kept))
    for out in (summarize_file(path), summarize_file(log)):
        assert out.returncode == 2 and 'Traceback' not in out.stderr, out.stderr
        assert "no closed 'step' range" in out.stderr and 'StandardUpdater' in out.stderr


def test_the_devices_copies_are_work_not_idle_time(nvtx_tool, tmp_path):
    """A step whose device copies a batch while no kernel runs was called
    idle, and the diagnosis said host-bound (try static_graph)."""
    events = run(nvtx_tool, tmp_path, poison=())
    roots, _ = nest(events)
    windows = [(s['start'], s['end']) for s in roots if s['name'] == 'step']
    path = export(tmp_path / 'copies.sqlite',
                  [(events, 5, dict(kernels=[(a, a + (b - a) // 2) for a, b in windows]))])
    before = summarize_file(path)
    db = sqlite3.connect(str(path))
    db.execute('CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER NOT NULL, end INTEGER '
               'NOT NULL, deviceId INTEGER NOT NULL, streamId INTEGER NOT NULL, '
               'globalPid INTEGER, bytes INTEGER NOT NULL)')
    db.executemany('INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?, ?, 0, 8, ?, 1024)',
                   [(a + (b - a) // 2, b, 5 << 24) for a, b in windows] +
                   [(a, b, 6 << 24) for a, b in windows[:1]])     # another process's
    db.commit()
    db.close()
    after = summarize_file(path)
    idle = [float(o.stdout.split('device idle: ')[1].split('%')[0]) for o in (before, after)]
    steps = [i for i, r in enumerate(roots) if r['name'] == 'step']
    expected = []           # busy through each step: idle in its extensions only
    for n, i in enumerate(steps[1:], 1):
        step = roots[i]
        following = roots[i + 1:steps[n + 1]] if n + 1 < len(steps) else roots[i + 1:]
        end = max([step['end']] + [r['end'] for r in following if 'end' in r])
        expected.append(1 - (step['end'] - step['start']) / (end - step['start']))
    assert idle[1] == pytest.approx(100 * statistics.median(expected), abs=0.06)
    assert idle[1] < idle[0], idle


def test_processes_of_two_machines_with_one_process_id_are_told_apart(nvtx_tool, tmp_path):
    events = run(nvtx_tool, tmp_path, poison=())
    machines = [(events, (m << 24) | 4711, dict(process_rows=True)) for m in (1, 2)]
    out = summarize_file(export(tmp_path / 'two.sqlite', machines), '--png',
                         str(tmp_path / 'c.png'))
    assert out.returncode == 0, out.stderr
    assert '== process 4711-1 (1 of 2) ==' in out.stdout
    assert '== process 4711-2 (2 of 2) ==' in out.stdout
    assert (tmp_path / 'c.pid4711-1.png').exists() and (tmp_path / 'c.pid4711-2.png').exists()
