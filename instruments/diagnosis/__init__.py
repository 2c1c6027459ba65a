"""The diagnosis scenarios and real-model rows that the tests check and ``benchmarks/diagnosis_table.py`` publishes."""
