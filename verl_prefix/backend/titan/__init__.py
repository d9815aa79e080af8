"""``prefix_torchtitan``: the schedule on verl's TorchTitan engine (TP, FSDP, EP, TP x EP, PP).

Importing this package imports nothing: verl's plugin import reaches ``registry`` alone, which registers engine
factories; torchtitan loads when an engine is built (``platform`` first, at the bottom of this package's layers).
Imports inside are absolute, so ``torchtitan`` is always the installed distribution.
"""
