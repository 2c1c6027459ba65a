"""The callback's arguments: validation, argument types, the class docstring.

Private: the public name is :class:`lightning_numguard.NumGuardCallback`.
"""
