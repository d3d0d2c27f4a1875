"""Collect the Markdown of every benchmark in a results directory into
SUMMARY.md (what `make bench` leaves for people to read)."""

import os
import sys


def main(directory):
    parts = []
    for name in sorted(os.listdir(directory)):
        if name.endswith('.md') and name != 'SUMMARY.md':
            with open(os.path.join(directory, name)) as f:
                text = f.read().strip()
            head, _, rest = text.partition('\n')
            if head.startswith('## '):      # which file: the quick or the full form
                text = '{} (`{}`)\n{}'.format(head, name, rest)
            parts.append(text)
    text = '# Benchmark results\n\nWritten by `make bench` (quick forms) or the command in ' \
           'each file; see benchmarks/README.md.\n\n' + '\n\n'.join(parts) + '\n'
    with open(os.path.join(directory, 'SUMMARY.md'), 'w') as f:
        f.write(text)
    print('wrote ' + os.path.join(directory, 'SUMMARY.md'))


if __name__ == '__main__':
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__),
                                                            'results'))
