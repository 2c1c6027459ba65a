"""``python -m lightning_numguard``: the ``numguard`` command line."""

from lightning_numguard.cli import main

raise SystemExit(main())
