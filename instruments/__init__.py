"""Test and benchmark instruments shared by ``tests/`` and ``benchmarks/`` (not shipped in the package).

``tests/`` and ``benchmarks/`` import from here and never from each other (``tests/test_architecture.py`` holds it):

* ``faults``: the fault-injecting model and data, and the quiet CPU Trainer;
* ``diagnosis``: the fault scenarios and the real-model rows of ``docs/diagnosis.md``, and their harness;
* ``bench_models``: the benchmark models and data; ``floor``: the floor callback (only the reads the defaults make);
* ``op_count``, ``compiled``, ``syncs``: the counters of kernel-launching ops, of inductor's kernels and dynamo's
  graphs, and of host reads;
* ``spike_table``: the false-spike clients; ``arguments_table``, ``event_fields``, ``readme_table``, ``markdown``: the
  generated docs' tables and the block writer.

The command lines that write the tables are ``python -m benchmarks.<name>``.
"""
