"""Framework-free core of ``lightning_numguard``: torch and the standard library only.

Every function here returns data (mostly device tensors) and never synchronises with the
host unless its docstring says so; deciding and acting is the callback's job.
"""
