"""The devices a device-parametrized test runs on: the CPU always (CI has no GPU), CUDA when there is one.

The CUDA tests' helpers take the device, so their Python (factories, spies, the arguments they pass the
library) runs in the CPU suite too: a signature change that breaks a CUDA test breaks its CPU run. What
only CUDA has (graph capture, pinned memory, side streams) is asserted where `device == "cuda"`; the
CPU run takes the same call with what the CPU does instead (graph=False, unpinned buffers, fills in line).
"""

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _id(value) -> str:
    return str(value).removeprefix("torch.")


def on_devices(argnames: str, cases: list, cpu: list | None = None):
    """Parametrize ("device", *argnames) over every case on CUDA (when there is one) and the cases in
    `cpu` (default: every case) on the CPU. The CPU runs fewer where a CPU test elsewhere covers the
    matrix in depth: there its run keeps the helper's calls in step with the library, in seconds."""
    names = [n.strip() for n in argnames.split(",")]
    one = len(names) == 1
    rows = lambda device, cs: [(device, c) if one else (device, *c) for c in cs]
    params = rows("cpu", cases if cpu is None else cpu) + (rows("cuda", cases) if CUDA else [])
    return pytest.mark.parametrize(["device", *names], params, ids=_id)
