"""torch_marlin: weight-quantized GEMM for PyTorch (Metal/MPS, CUDA, CPU).

Ops live under ``torch.ops.marlin``; :class:`MarlinLinear` is the drop-in module.
"""

import torch

_MIN_TORCH = (2, 4)
if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < _MIN_TORCH:
    raise ImportError(f"torch_marlin needs torch >= 2.4, found {torch.__version__}")

from . import _C  # noqa: E402,F401  (registers torch.ops.marlin.*)
from . import ops  # noqa: E402,F401  (fake kernels for torch.compile)
from .planner import plan_gemm  # noqa: E402
from .modules import MarlinLinear, RansLinear  # noqa: E402
from .planner import plan_trellis, plan_trellis_moe  # noqa: E402
from .planner import plan_rans  # noqa: E402
from .modules import TrellisLinear, TrellisMoE  # noqa: E402

__all__ = ["MarlinLinear", "RansLinear", "plan_gemm", "ops", "TrellisLinear", "TrellisMoE", "plan_trellis",
           "plan_trellis_moe", "plan_rans"]
from .version import __version__  # noqa: E402

# Real models: patching, quantized checkpoints, other tools' checkpoints (none of these imports transformers
# until called).
from .patching import entropy_code, patch_model  # noqa: E402
from .checkpoint import load_quantized, save_quantized  # noqa: E402
from .loaders.gptq import import_gptq, marlin_linear_from_gptq  # noqa: E402

from .loaders.pretrained import from_pretrained  # noqa: E402

__all__ += ["patch_model", "entropy_code", "save_quantized", "load_quantized", "marlin_linear_from_gptq", "import_gptq",
            "from_pretrained"]


def __getattr__(name):
    # The transformers integration imports transformers: only on first use of its names.
    if name in ("TorchMarlinConfig", "TorchMarlinHfQuantizer"):
        from . import hf_quantizer
        return getattr(hf_quantizer, name)
    raise AttributeError(f"module 'torch_marlin' has no attribute {name!r}")


import importlib.abc as _abc  # noqa: E402
import importlib.util as _util  # noqa: E402
import sys as _sys  # noqa: E402


def _register_with_transformers() -> None:
    """Registers the transformers integration, so AutoModel*.from_pretrained reads torch_marlin
    checkpoints (without it transformers skips the unknown quant_method and loads float layers)."""
    try:
        from . import hf_quantizer  # noqa: F401
    except ImportError:  # a transformers without the quantizer registry: the integration stays off
        pass


class _OnTransformersImport(_abc.MetaPathFinder):
    """Registers the integration right after transformers is first imported, whichever of the two
    packages a program imports first, without importing transformers itself. A spec looked up
    without loading (``importlib.util.find_spec``) leaves the hook in place for the real import."""

    looking_up = False

    def find_spec(self, name, path=None, target=None):
        if name != "transformers" or self.looking_up:
            return None
        self.looking_up = True  # the lookup below must not come back here
        try:
            spec = _util.find_spec(name)
        finally:
            self.looking_up = False
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                if self in _sys.meta_path:
                    _sys.meta_path.remove(self)
                _register_with_transformers()

            spec.loader.exec_module = exec_module
        return spec


if "transformers" in _sys.modules:
    _register_with_transformers()
else:
    _sys.meta_path.insert(0, _OnTransformersImport())
