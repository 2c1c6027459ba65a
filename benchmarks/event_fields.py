"""``python -m benchmarks.event_fields``: the table of event fields in ``docs/reference.md``, rendered from ``Event``'s
own declaration (never typed by hand).

The code is :mod:`instruments.event_fields`, shared with the tests that hold its results.
"""

from instruments.event_fields import main

if __name__ == "__main__":
    main()
