"""Programmatic dependent launch (PDL) for the engine's Triton kernels, on Hopper GPUs and later.

A kernel launched with PDL may be set up while the kernel before it in the stream finishes. Its programs first
wait (`gdc_wait`: griddepcontrol.wait) until that kernel has completed and its writes are visible, before they
read or write anything, so nothing changes but the time between the two: in a one-sequence decode step on an H100
the GPU sat idle 0.5 us between kernels on average, 261 kernels a step. Each kernel lets the next one launch once
its programs have loaded what they read (`gdc_launch_dependents`). CUDA graphs keep the dependency as captured.
torch.compile's own kernels do the same with inductor's `triton.enable_pdl` (runner/compilation.py).
"""

import functools

import torch


@functools.cache
def enabled(device: int | None = None) -> bool:
    """Whether kernels on this CUDA device launch with PDL (compute capability 9.0 and later)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def launch() -> dict:
    """A Triton launch's keyword arguments for PDL on the current device: the kernel's USE_PDL (which makes it wait
    for the kernel before, and let the next launch) and Triton's own launch_pdl. Made once (every launch unpacks the
    same dict; none changes it): an engine process drives one device."""
    on = enabled()
    return {"USE_PDL": on, "launch_pdl": on}
