"""Estimating: the profile table and everything computed from it, in plain numpy.

The profile (:mod:`.profile`, :mod:`.table`) holds what the profiler recorded as integer
polynomials in the batch and the sequence length; the estimator, the levers, the sharding
strategies, the allocator replay, the decode-step pattern and the trade-off searches turn it
into a :class:`~vram_widget.MemoryEstimate` per setting. No module here imports torch (an
import-linter contract in ``pyproject.toml``), so a slider move never runs a model.
"""
