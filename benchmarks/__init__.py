"""Benchmarks of ``lightning_numguard``: is the guard cheap enough to leave on?

Run from the repository root, as modules (no ``sys.path`` editing anywhere)::

    python -m benchmarks.overhead --help   # end to end: step time, host reads, cProfile, then micro
    python -m benchmarks.micro --help      # the guard's building blocks alone

Modules: ``overhead`` (the command line and orchestration), ``harness`` (timed fits, interleaved
rounds, the step clock, host-read counts), ``variants`` (what each variant runs), ``profiling``
(cProfile breakdown), ``tables`` (markdown tables and the verdict against the targets),
``micro`` (micro-measurements), ``bench_models`` (models and data). See ``benchmarks/README.md``.
"""
