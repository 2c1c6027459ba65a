"""The step, in its order: the flow and its read schedules, what a step records, its one read, the diagnosis of a hit,
the replay glue, micro-batches under accumulation, and the checks that run beside the flags (coverage, spikes).

Private: the public name is :class:`lightning_numguard.NumGuardCallback`.
"""
