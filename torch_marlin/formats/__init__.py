"""Weight formats in plain torch: packing, quantizers and the dequant references the tests use.

Everything here is deliberately simple, readable torch code: it is the independent reference
every kernel is checked against. Exact layouts are written down in docs/formats.md.
"""

from .int4_packing import pack_int4, unpack_int4
from .fp4 import E2M1_VALUES, dequant_fp4_reference, pack_fp4_weights, quantize_fp4
from .u4 import dequant_u4_reference, quantize_u4
from .affine import dequant_affine_reference, quantize_affine

__all__ = [
    "E2M1_VALUES",
    "pack_int4",
    "unpack_int4",
    "pack_fp4_weights",
    "quantize_fp4",
    "dequant_fp4_reference",
    "quantize_u4",
    "dequant_u4_reference",
    "quantize_affine",
    "dequant_affine_reference",
]
