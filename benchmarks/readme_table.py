"""``python -m benchmarks.readme_table``: the README's benchmark table, generated from a results file (never typed by
hand).

The code is :mod:`instruments.readme_table`, shared with the tests that hold its results.
"""

from instruments.readme_table import main

if __name__ == "__main__":
    main()
