"""``python -m benchmarks.op_count``: how many kernel-launching ops the guard adds to a training step, counted at the
dispatcher, by check.

The code is :mod:`instruments.op_count`, shared with the tests that hold its results.
"""

from instruments.op_count import main

if __name__ == "__main__":
    main()
