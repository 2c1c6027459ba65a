"""What the callback shows while it runs: logged series, progress-bar entries and the summary, AMP counters, and
whether a run writes files at all.

Private: the public name is :class:`lightning_numguard.NumGuardCallback`.
"""
