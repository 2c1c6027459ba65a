"""``python -m benchmarks.arguments_table``: the table of arguments in ``docs/reference.md``, rendered from their
declarations (never typed by hand).

The code is :mod:`instruments.arguments_table`, shared with the tests that hold its results.
"""

from instruments.arguments_table import main

if __name__ == "__main__":
    main()
