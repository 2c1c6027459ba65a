"""``python -m benchmarks.compiled``: what the guard adds to a ``torch.compile``d model, counted by inductor and dynamo
themselves.

The code is :mod:`instruments.compiled`, shared with the tests that hold its results.
"""

from instruments.compiled import main

if __name__ == "__main__":
    main()
