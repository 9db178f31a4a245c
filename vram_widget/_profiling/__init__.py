"""Profiling: everything that runs the model, on fake tensors or for real.

The profiler runs a step under the recorder (a TorchDispatchMode) on fake tensors, with
CUDA's kernel choices emulated (:mod:`.cuda_rules`), HF's ``generate`` recorded
(:mod:`.generation`) and CPU kernel workspaces probed (:mod:`.probe`), and hands the traces
to the estimating stage; :mod:`.measure` and :mod:`.distributed` run real steps, the truth the
estimates are checked against. Every private torch import lives in :mod:`.fake`.
"""
