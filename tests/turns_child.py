"""A stand-in variant for benchmarks/_turns.py's tests (run with ``python -P``).

``turns_child.py MODE TICKS --reply-fd N``: a variant whose step sleeps 50 ms
and which, like a rung with loader workers and a prefetch thread, has a
forked worker process and a thread appending a byte to ``TICKS.worker`` and
``TICKS.thread`` every 2 ms. MODE: ``ok``; ``build_error`` (the build
raises); ``die`` (its second step, settling included, exits the process
with status 3);
``hang`` (a step sleeps for a minute).
"""

import multiprocessing
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..',
                                'benchmarks'))
import _turns  # noqa: E402


def tick(path):
    while True:
        with open(path, 'a') as f:
            f.write('x')
        time.sleep(0.002)


def main():
    fd, argv = _turns.reply_fd(sys.argv[1:])
    mode, ticks = argv
    state = {'steps': 0}

    def build():
        if mode == 'build_error':
            raise ValueError('no such rung here')
        worker = multiprocessing.get_context('fork').Process(
            target=tick, args=(ticks + '.worker',), daemon=True)
        worker.start()
        threading.Thread(target=tick, args=(ticks + '.thread',), daemon=True).start()

        def step():
            state['steps'] += 1
            if mode == 'die' and state['steps'] == 2:
                os._exit(3)
            time.sleep(60 if mode == 'hang' else 0.05)

        return step, lambda: {'steps': state['steps'], 'worker': worker.pid}, {'pid': os.getpid()}

    _turns.serve(fd, build)


if __name__ == '__main__':
    main()
