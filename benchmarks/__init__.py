"""Benchmarks of ``lightning_numguard``: is the guard cheap enough to leave on?

Run from the repository root, as modules (no ``sys.path`` editing anywhere)::

    python -m benchmarks.overhead --help   # end to end: step time, host reads, cProfile, then micro
    python -m benchmarks.micro --help      # the guard's building blocks alone

Modules: ``overhead`` (the command line and orchestration), ``harness`` (timed fits, interleaved
rounds, the step clock, host-read counts), ``variants`` (what each variant runs), ``profiling``
(cProfile breakdown), ``tables`` (markdown tables and the verdict against the targets),
``micro`` (micro-measurements). The models and data (``bench_models``), the floor (``floor``), the op and compile
counters and the doc tables' code are in ``instruments/``, shared with the tests; the commands that write their tables
(``python -m benchmarks.op_count``, ``compiled``, ``spike_table``, ``arguments_table``, ``event_fields``,
``readme_table``) stay here. See ``benchmarks/README.md``.
"""
