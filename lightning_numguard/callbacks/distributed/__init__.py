"""Ranks and strategies: reductions through ``trainer.strategy``, sharded snapshots, the strategy check at setup.

Private: the public name is :class:`lightning_numguard.NumGuardCallback`.
"""
