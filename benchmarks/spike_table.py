"""``python -m benchmarks.spike_table``: false and caught spikes of the shipped spike detector on real clients: the
table of ``docs/reference.md#spikes``.

The code is :mod:`instruments.spike_table`, shared with the tests that hold its results.
"""

from instruments.spike_table import main

if __name__ == "__main__":
    main()
