"""The backends the op tests run on, as pytest parameters.

Every backend takes CPU tensors, runs one ``torch.ops.marlin`` op where it lives and returns the
result on the CPU, so one test body checks them all against the same reference:

* ``cpu``: ``torch.ops.marlin`` on CPU tensors;
* ``metal_emu``: the Metal kernels in the Metal-on-CPU harness (tests/metal_emu.py: FP4 / INT4 and
  rANS; tests/trellis_metal_emu.py), planned by the same planner the MPS backend uses; runs everywhere;
* ``cuda``: ``torch.ops.marlin`` on CUDA tensors (skipped without a CUDA device);
* ``mps``: ``torch.ops.marlin`` on MPS tensors (skipped without an Apple GPU).

Usage: ``@pytest.mark.parametrize("backend", BACKENDS)``, then ``backend.gemm_fp4(A, B, s, 128)``.
A backend without kernels for an op skips the test (``backend.require(op)`` up front).
"""

import zlib

import pytest
import torch

import torch_marlin  # noqa: F401  (registers the ops whose CUDA kernels the CUDA backend lists)

INT4_OPS = ("gemm_fp4", "gemm_u4", "dequant_fp4", "dequant_u4", "gemm_affine", "dequant_affine")
TRELLIS_OPS = ("gemm_trellis", "dequant_trellis", "moe_trellis")
RANS_OPS = ("rans_decode", "gemm_rans")  # rans_encode runs on the CPU only (tests/test_rans_ops.py)
OPS = INT4_OPS + TRELLIS_OPS + RANS_OPS

# Thread orders of the harness's executor; each call gets one, picked from its arguments so a
# test case always runs the same order and the matrix as a whole covers all of them.
SCHEDULES = ("forward", "reverse", "random", "simd_ahead", "simd_ahead_reverse")


class Backend:
    name = ""
    #: True where the kernels multiply by the exact fp32 dequantized weight with IEEE fp32 sums
    #: (tests/reference.py, error bounds); False where they round weights to the activation dtype.
    exact_products = False
    ops = OPS

    def require(self, op: str) -> None:
        if op not in self.ops:
            pytest.skip(f"{op} has no {self.name} kernels")

    def run(self, op: str, *args):
        raise NotImplementedError

    def __getattr__(self, op):
        if op not in OPS:
            raise AttributeError(op)
        def call(*args):
            self.require(op)
            return self.run(op, *args)

        return call

    def __repr__(self):
        return self.name


class DeviceBackend(Backend):
    """The registered op on tensors of one torch device."""

    def __init__(self, name: str, device: str, exact_products: bool, ops=OPS):
        self.name, self.device, self.exact_products, self.ops = name, device, exact_products, ops

    def run(self, op, *args):
        self.require(op)
        moved = [a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args]
        return getattr(torch.ops.marlin, op)(*moved).cpu()


class MetalEmuBackend(Backend):
    """The Metal kernels run as C++ threads on the CPU (docs/metal.md), CPU tensors in and out."""

    name = "metal_emu"

    def run(self, op, *args):
        import metal_emu
        import trellis_metal_emu

        module = metal_emu if op in INT4_OPS + RANS_OPS else trellis_metal_emu
        key = repr([(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args])
        crc = zlib.crc32(f"{op}{key}".encode())
        if op == "moe_trellis":  # the harness takes gate, up and down as lists, like torch_marlin.ops
            args = (args[0], args[1:6], args[6:11], args[11:16], *args[16:])
        return getattr(module, op)(*args, schedule=SCHEDULES[crc % len(SCHEDULES)], seed=crc)


CPU = DeviceBackend("cpu", "cpu", exact_products=True)
METAL_EMU = MetalEmuBackend()


def registered_ops(dispatch_key: str) -> tuple:
    """The ops this build registers for a device's dispatch key (a family without kernels there is skipped)."""
    return tuple(op for op in OPS if torch._C._dispatch_has_kernel_for_dispatch_key(f"marlin::{op}", dispatch_key))


CUDA = DeviceBackend("cuda", "cuda", exact_products=False, ops=registered_ops("CUDA"))
MPS = DeviceBackend("mps", "mps", exact_products=False, ops=registered_ops("MPS"))

BACKENDS = [
    pytest.param(CPU, id="cpu"),
    pytest.param(METAL_EMU, id="metal_emu", marks=pytest.mark.metal_emu),
    pytest.param(CUDA, id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                            reason="needs a CUDA device")),
    pytest.param(MPS, id="mps", marks=pytest.mark.skipif(not torch.backends.mps.is_available(),
                                                         reason="needs an Apple GPU (MPS)")),
]

#: The backends that run the registered ops on a real device (opcheck needs the dispatcher).
DEVICE_BACKENDS = [p for p in BACKENDS if p.values[0] is not METAL_EMU]


def cases(values, skip=None):
    """``BACKENDS`` x ``values`` as pytest params (``backend`` first), leaving out the combinations
    where ``skip(backend, *value)`` is true; marks and ids of the backends carry over."""
    out = []
    for b in BACKENDS:
        backend = b.values[0]
        for v in values:
            v = v if isinstance(v, tuple) else (v,)
            if skip is not None and skip(backend, *v):
                continue
            vid = "-".join(str(x).replace("torch.", "") for x in v)
            out.append(pytest.param(backend, *v, id=f"{b.id}-{vid}", marks=b.marks))
    return out


def assert_chain_matches_synchronized(chain):
    """``chain(sync)`` runs back-to-back CUDA calls, each reading the previous one's output, with
    the device synchronized between them when ``sync``. Eagerly and from a CUDA graph (captured
    once, replayed three times) the result must equal the synchronized chain's bitwise: a kernel
    launched behind the previous one (programmatic dependent launch) waits for it before it reads."""
    ref = chain(True).clone()
    assert ref.isfinite().all() and ref.abs().max() > 0.1
    eager = chain(False)
    torch.cuda.synchronize()
    assert torch.equal(eager, ref)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (per-stream K-slice counters)
        chain(False)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        out = chain(False)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
