"""Trellis codebook ops (gemm_trellis, dequant_trellis, moe_trellis) on every backend of
tests/backends.py against plain-torch references (tests/reference.py: fp64 matmuls on weights from
``dequant_trellis_reference``, error bounds there).

Shapes are never multiples of the 16-row index tiles or the 32 / 64 kernel tiles, and group size
128 leaves a partial last group.
"""

import itertools

import pytest
import torch

from torch_marlin.formats import trellis as trellis_format

from backends import BACKENDS, CUDA, DEVICE_BACKENDS, assert_chain_matches_synchronized, cases
from reference import assert_moe_close, assert_trellis_gemm_close, dequant_ref, moe_case, moe_reference, random_trellis

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
BITS = [2, 3, 4]


# ---- dequant_trellis ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend, bits, gs, K, N", cases(
    [(b, g, K, N) for b, g, (K, N) in itertools.product(BITS, [32, 128], [(200, 77), (37, 300)])]))
def test_dequant_trellis(backend, bits, gs, K, N):
    t = random_trellis(K, N, bits, gs, seed=bits * 7 + gs)
    W = backend.dequant_trellis(*t, K, N, bits, gs)
    assert W.dtype == torch.float32 and W.shape == (K, N)
    # The fp32 products grid * scale * su * sv, possibly in another order: 2 ulp.
    torch.testing.assert_close(W.double(), dequant_ref(t, K, N, bits, gs), rtol=3e-7, atol=1e-9)


# ---- gemm_trellis ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, bits, gs, M, dtype", cases(list(itertools.product(
    BITS, [32, 128], [1, 5, 16, 17, 100], DTYPES))))
def test_gemm_trellis(backend, bits, gs, M, dtype):
    # Decode rows (M <= 16) and prefill rows; K = 200 / 144 and N = 77 / 100 cut every tile.
    K, N = (200, 77) if M % 2 else (144, 100)
    t = random_trellis(K, N, bits, gs, seed=M * 7 + bits)
    A = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
    C = backend.gemm_trellis(A, *t, K, N, bits, gs)
    assert C.dtype == dtype and C.shape == (M, N)
    assert_trellis_gemm_close(C, A, dequant_ref(t, K, N, bits, gs), backend.exact_products)


@pytest.mark.parametrize("backend, bits, M", cases(list(itertools.product(BITS, [3, 33]))))
def test_gemm_trellis_larger_shape(backend, bits, M):
    K, N, gs = 1040, 1000, 128  # several K chunks (256) and column panels on the CPU prefill path
    t = random_trellis(K, N, bits, gs, seed=3)
    A = torch.randn(M, K)
    assert_trellis_gemm_close(backend.gemm_trellis(A, *t, K, N, bits, gs), A, dequant_ref(t, K, N, bits, gs),
                              backend.exact_products)


@pytest.mark.parametrize("backend, dtype", [pytest.param(p.values[0], d, id=f"{p.id}-{d}".replace("torch.", ""),
                                                           marks=p.marks)
                                              for p in BACKENDS if p.id != "metal_emu"
                                              for d in (torch.float16, torch.bfloat16)])
def test_gemm_trellis_many_rows(backend, dtype):
    # 600 rows: the CUDA planner's dense-weight + cuBLAS family (the CPU prefill elsewhere). N = 136
    # takes the CUDA dequant's 16-byte stores on its whole tiles, N = 77 the element stores.
    for K, N, bits in ((200, 77, 3), (144, 136, 4)):
        gs = 32
        t = random_trellis(K, N, bits, gs, seed=2)
        A = torch.randn(600, K, generator=torch.Generator().manual_seed(1)).to(dtype)
        assert_trellis_gemm_close(backend.gemm_trellis(A, *t, K, N, bits, gs), A, dequant_ref(t, K, N, bits, gs),
                                  backend.exact_products)


@pytest.mark.parametrize("backend, bits, M", cases(list(itertools.product(BITS, [1, 12]))))
def test_gemm_trellis_decode_k_not_multiple_of_8(backend, bits, M):
    # K % 8 != 0: the CUDA planner's tensor-core decode kernel instead of the streaming one.
    K, N, gs = 203, 77, 32
    t = random_trellis(K, N, bits, gs, seed=5)
    A = torch.randn(M, K, generator=torch.Generator().manual_seed(2)).half()
    assert_trellis_gemm_close(backend.gemm_trellis(A, *t, K, N, bits, gs), A, dequant_ref(t, K, N, bits, gs),
                              backend.exact_products)


# ---- indices in the CUDA lane layout ----------------------------------------------------------

def with_lanes(t, K, N, bits):
    return (trellis_format.tiles_to_lanes(t[0], K, N, bits),) + tuple(t[1:])


@pytest.mark.parametrize("backend, bits, gs, M, dtype", cases(list(itertools.product(
    BITS, [32, 128], [1, 5, 16, 17], DTYPES)), skip=lambda b, *v: b is not CUDA))
def test_gemm_trellis_lane_layout(backend, bits, gs, M, dtype):
    # The streaming decode (fp16 / bf16, M <= 16) and the lane dequant + cuBLAS (fp32, M > 16; K % 8
    # != 0) read the lane layout. K = 200 has a partial last chunk, 1040 several stages and slices.
    for K, N in ((200, 77), (1040, 300), (203, 48)):
        t = random_trellis(K, N, bits, gs, seed=M * 7 + bits)
        A = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
        C = backend.gemm_trellis(A, *with_lanes(t, K, N, bits), K, N, bits, gs)
        assert C.dtype == dtype and C.shape == (M, N)
        assert_trellis_gemm_close(C, A, dequant_ref(t, K, N, bits, gs), backend.exact_products)
        # The same products in the same order as the kernels reading the canonical tiles, where
        # both run the streaming decode or both the dense weight + cuBLAS.
        if K % 8 == 0 and dtype != torch.float32:
            assert torch.equal(C, backend.gemm_trellis(A, *t, K, N, bits, gs))


@pytest.mark.parametrize("backend, M, K, wide, slice_tiles, k_parallel", cases(
    [(1, 4104, True, 72, 4), (16, 4104, True, 64, 5), (16, 8200, False, 24, 22)], skip=lambda b, *v: b is not CUDA))
def test_gemm_trellis_decode_k_slices(backend, M, K, wide, slice_tiles, k_parallel):
    # The streaming decode's K slices. "wide": one column block per SM, so the planner wants 4
    # slices (33 stages, a partial last tile): 9 stages each at M = 1; at M = 16 a slice holds at
    # most 64 tile rows (the block converts its slice's activations into shared memory once), so 5.
    # N = 77: one column block, 32 slices wanted, 22 of 3 stages.
    import torch_marlin
    bits, gs = 3, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    N = 128 * sms - 8 if wide else 77
    plan = torch_marlin.plan_trellis(M, K, N, bits, gs, torch.float16, device="cuda", layout="lanes")
    assert (plan["kernel"], plan["k_slice_tiles"], plan["k_parallel"]) == (
        "gemm_trellis_decode_lanes_half", slice_tiles, k_parallel)
    assert plan["reduce"]["dependent_launch"] == plan["thread_block_clusters"]
    t = random_trellis(K, N, bits, gs, seed=11)
    A = torch.randn(M, K, generator=torch.Generator().manual_seed(3)).half()
    C = backend.gemm_trellis(A, *with_lanes(t, K, N, bits), K, N, bits, gs)
    assert_trellis_gemm_close(C, A, dequant_ref(t, K, N, bits, gs), backend.exact_products)
    assert torch.equal(C, backend.gemm_trellis(A, *t, K, N, bits, gs))


@pytest.mark.parametrize("backend, layout, M, dtype", cases(list(itertools.product(
    ["tiles", "lanes"], [1, 16], [torch.float16, torch.bfloat16])), skip=lambda b, *v: b is not CUDA))
def test_gemm_trellis_chain_dependent_launch(backend, layout, M, dtype):
    # Back-to-back streaming decodes, each reading the previous one's output: 4096 -> 1024 in many K
    # slices, 1024 -> 4096, 4096 -> 4096, 4096 -> 2048 and 2048 -> 2048 in fewer. On sm_90 a decode
    # launches behind the previous kernel (the last decode or its K-slice reduction), warms L2 with
    # its first indices and waits for that kernel before it reads. Eagerly and from a CUDA graph the
    # chain must equal the same calls with the device synchronized between them, bitwise.
    import torch_marlin
    bits, gs, dims = 3, 128, [4096, 1024, 4096, 4096, 2048, 2048]
    layers = []
    for i, (K, N) in enumerate(zip(dims[:-1], dims[1:])):
        t = random_trellis(K, N, bits, gs, seed=20 + i)
        t = with_lanes(t, K, N, bits) if layout == "lanes" else t
        scales = t[1] * (8 / K**0.5)  # outputs stay O(1) along the chain
        layers.append(((t[0], scales) + tuple(t[2:]), K, N))
        plan = torch_marlin.plan_trellis(M, K, N, bits, gs, dtype, device="cuda", layout=layout)
        assert plan["cuda_stream_decode"] and plan["dependent_launch"] == plan["thread_block_clusters"], plan
    layers = [(tuple(v.cuda() for v in t), K, N) for t, K, N in layers]
    x = torch.randn(M, dims[0], device="cuda", dtype=dtype)

    def chain(sync):
        y = x
        for t, K, N in layers:
            y = torch.ops.marlin.gemm_trellis(y, *t, K, N, bits, gs)
            if sync:
                torch.cuda.synchronize()
        return y

    assert_chain_matches_synchronized(chain)


@pytest.mark.parametrize("backend, bits", cases([3, 4], skip=lambda b, *v: b is not CUDA))
def test_gemm_trellis_decode_long_slices(backend, bits):
    # 16 rows at 3 and 4 bits: K slices of at least 3 stages where that leaves two blocks per SM.
    # 4096 x 4096 (32 column blocks, 32 stages): 11 slices, the last of 2 stages.
    import torch_marlin
    K, N, M, gs = 4096, 4096, 16, 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = torch_marlin.plan_trellis(M, K, N, bits, gs, torch.float16, device="cuda", layout="lanes")
    if 32 * 11 >= 2 * sms:
        assert (plan["k_slice_tiles"], plan["k_parallel"]) == (24, 11), plan
    t = random_trellis(K, N, bits, gs, seed=bits)
    A = torch.randn(M, K, generator=torch.Generator().manual_seed(4)).half()
    C = backend.gemm_trellis(A, *with_lanes(t, K, N, bits), K, N, bits, gs)
    assert_trellis_gemm_close(C, A, dequant_ref(t, K, N, bits, gs), backend.exact_products)
    assert torch.equal(C, backend.gemm_trellis(A, *t, K, N, bits, gs))


@pytest.mark.parametrize("backend, bits, gs, dtype", cases(list(itertools.product(
    BITS, [32, 128], [torch.float16, torch.bfloat16])), skip=lambda b, *v: b is not CUDA))
def test_gemm_trellis_wgmma_prefill(backend, bits, gs, dtype):
    # The sm_90a prefill kernel on lane-layout indices, where the planner picks it (column blocks
    # for at least half the SMs, 64..256 rows): 128-row blocks (M = 64: a partial one; M = 200: a
    # partial second) and a partial 256-row block (M = 130), K with a partial last lane chunk (200,
    # 264) and several chunks (1040), N with a partial last tile and column block.
    import torch_marlin
    if not torch_marlin.plan_trellis(64, 200, 12600, bits, gs, dtype, device="cuda", layout="lanes")["wgmma"]:
        pytest.skip("this GPU runs no sm_90a kernels (caps wgmma), which the trellis wgmma kernel needs")
    tile_rows = set()
    for M, K, N in ((64, 200, 12600), (200, 1040, 17100), (130, 264, 9000)):
        plan = torch_marlin.plan_trellis(M, K, N, bits, gs, dtype, device="cuda", layout="lanes")
        assert plan["family"] == "wgmma" and plan["grid"] == (-(-M // plan["tile_m"]), -(-N // 128), 1), plan
        tile_rows.add(plan["tile_m"])
        t = random_trellis(K, N, bits, gs, seed=M + bits)
        A = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
        C = backend.gemm_trellis(A, *with_lanes(t, K, N, bits), K, N, bits, gs)
        assert C.dtype == dtype and C.shape == (M, N)
        assert_trellis_gemm_close(C, A, dequant_ref(t, K, N, bits, gs), backend.exact_products)
        assert torch.equal(C, backend.gemm_trellis(A, *with_lanes(t, K, N, bits), K, N, bits, gs))
    assert tile_rows == {128, 256}


@pytest.mark.parametrize("backend, bits, K, N", cases(
    [(b, K, N) for b, (K, N) in itertools.product(BITS, [(200, 77), (37, 300), (1040, 48)])],
    skip=lambda b, *v: b is not CUDA))
def test_dequant_trellis_lane_layout(backend, bits, K, N):
    t = random_trellis(K, N, bits, 32, seed=bits)
    W = backend.dequant_trellis(*with_lanes(t, K, N, bits), K, N, bits, 32)
    # Against the reference as test_dequant_trellis (2 ulp), and bitwise against the tiles' kernel.
    torch.testing.assert_close(W.double(), dequant_ref(t, K, N, bits, 32), rtol=3e-7, atol=1e-9)
    assert torch.equal(W, backend.dequant_trellis(*t, K, N, bits, 32))


@pytest.mark.parametrize("backend", [p for p in DEVICE_BACKENDS if p.values[0] is not CUDA])
def test_lane_layout_is_refused_off_cuda(backend):
    K, N, bits = 200, 77, 3
    lanes = with_lanes(random_trellis(K, N, bits, 32), K, N, bits)
    with pytest.raises(ValueError, match="CUDA lane layout, which only the CUDA kernels read"):
        backend.gemm_trellis(torch.randn(1, K), *lanes, K, N, bits, 32)
    with pytest.raises(ValueError, match="CUDA lane layout, which only the CUDA kernels read"):
        backend.dequant_trellis(*lanes, K, N, bits, 32)
    # A shape that is neither layout names both.
    with pytest.raises(ValueError, match=r"or, in the CUDA lane layout, \[2, 5, 768\]"):
        backend.dequant_trellis(lanes[0][:, :, :-1], *lanes[1:], K, N, bits, 32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemm_trellis_empty_and_non_contiguous(backend):
    K, N, bits, gs = 64, 48, 3, 32
    t = random_trellis(K, N, bits, gs)
    assert backend.gemm_trellis(torch.randn(0, K), *t, K, N, bits, gs).shape == (0, N)
    A = torch.randn(K, 9).t()  # non-contiguous [9, K]
    assert_trellis_gemm_close(backend.gemm_trellis(A, *t, K, N, bits, gs), A, dequant_ref(t, K, N, bits, gs),
                              backend.exact_products)


# ---- moe_trellis -------------------------------------------------------------------------------

def run_moe(backend, x, gate, up, down, ids, probs, I, bits, gs):
    return backend.moe_trellis(x, *gate, *up, *down, ids, probs, I, bits, gs)


@pytest.mark.parametrize("backend, top_k, routing, T", cases(list(itertools.product(
    [1, 2], ["random", "some_empty", "all_to_one"], [1, 5, 40]))))
def test_moe_trellis(backend, top_k, routing, T):
    # Experts without tokens, and (T = 40, all_to_one) experts with more than 16 rows, which the
    # Metal kernels run as 64 x 64 tiles instead of GEMVs.
    H, I, E, bits, gs = 72, 112, 6, 3, 32
    gate, up, down, ids, probs = moe_case(T, H, I, E, top_k, bits, gs, routing, seed=T + top_k)
    x = torch.randn(T, H) * 0.5
    y = run_moe(backend, x, gate, up, down, ids, probs, I, bits, gs)
    assert y.shape == (T, H)
    assert_moe_close(y, moe_reference(x, gate, up, down, ids, probs, H, I, bits, gs), torch.float32,
                     backend.exact_products)


@pytest.mark.parametrize("backend, dtype, bits", cases(list(itertools.product(DTYPES, [2, 4]))))
def test_moe_trellis_dtypes_bits(backend, dtype, bits):
    T, H, I, E, top_k, gs = 20, 64, 48, 4, 2, 32
    gate, up, down, _, probs = moe_case(T, H, I, E, top_k, bits, gs, "random", seed=bits)
    # Expert 3 gets all 20 tokens (tiles on Metal), experts 0..2 get 6-7 each (GEMVs).
    ids = torch.stack([torch.full((T,), E - 1), torch.arange(T) % 3], 1)
    x = (torch.randn(T, H) * 0.5).to(dtype)
    if bits == 2:  # int32 ids and probs in the activation dtype are accepted too
        ids, probs = ids.to(torch.int32), probs.to(dtype)
    y = run_moe(backend, x, gate, up, down, ids, probs, I, bits, gs)
    # The reference uses the probs as the kernel received them (read as f32).
    ref = moe_reference(x, gate, up, down, ids, probs.float(), H, I, bits, gs)
    assert_moe_close(y, ref, dtype, backend.exact_products)


@pytest.mark.parametrize("backend, bits, gs", cases(list(itertools.product(BITS, [32, 128]))))
def test_moe_trellis_bits_group_sizes(backend, bits, gs):
    # hidden 200 and intermediate 136: neither a multiple of 16 / 32, partial last scale groups.
    T, H, I, E, top_k = 24, 200, 136, 5, 2
    gate, up, down, ids, probs = moe_case(T, H, I, E, top_k, bits, gs, "all_to_one" if gs == 128 else "random",
                                          seed=bits * gs)
    x = (torch.randn(T, H) * 0.3).half()
    y = run_moe(backend, x, gate, up, down, ids, probs, I, bits, gs)
    assert_moe_close(y, moe_reference(x, gate, up, down, ids, probs, H, I, bits, gs), torch.float16,
                     backend.exact_products)


@pytest.mark.parametrize("backend, dtype, bits, gs, T, top_k, routing", cases([
    (torch.float16, 3, 128, 1, 8, "random"), (torch.bfloat16, 2, 32, 2, 8, "random"),
    (torch.float16, 4, 32, 3, 2, "some_empty"), (torch.bfloat16, 3, 128, 1, 4, "all_to_one")]))
def test_moe_trellis_decode_rows(backend, dtype, bits, gs, T, top_k, routing):
    # fp16 / bf16 at decode batches (T * top_k <= 16: 8-row and 16-row tiles on CUDA's streaming
    # kernel). hidden 264 and intermediate 200 are multiples of 8 but not of 16: partial tiles and
    # groups, and gate/up and down both cut into K slices that down sums while staging.
    H, I, E = 264, 200, 12
    gate, up, down, ids, probs = moe_case(T, H, I, E, top_k, bits, gs, routing, seed=T * 10 + bits)
    x = (torch.randn(T, H, generator=torch.Generator().manual_seed(T)) * 0.5).to(dtype)
    if dtype == torch.bfloat16:
        ids = ids.to(torch.int32)  # read by the kernels themselves at one token on CUDA
    y = run_moe(backend, x, gate, up, down, ids, probs, I, bits, gs)
    assert y.dtype == dtype and y.shape == (T, H)
    assert_moe_close(y, moe_reference(x, gate, up, down, ids, probs, H, I, bits, gs), dtype, backend.exact_products)
    assert torch.equal(y, run_moe(backend, x, gate, up, down, ids, probs, I, bits, gs))  # deterministic


@pytest.mark.parametrize("backend, T", [pytest.param(p.values[0], T, id=f"{p.id}-T{T}", marks=p.marks)
                                        for p in BACKENDS if p.id in ("cuda", "mps") for T in (1, 3)])
def test_moe_trellis_clamps_expert_ids_on_gpus(backend, T):
    # A GPU does not sync to check expert_ids: an id outside [0, E) acts as the nearest expert
    # (the CPU raises instead, test_moe_errors_name_the_argument), with or without the routing pass.
    H, I, E, top_k, bits, gs = 264, 200, 6, 2, 3, 32
    gate, up, down, ids, probs = moe_case(T, H, I, E, top_k, bits, gs, "random", seed=4)
    bad = ids.clone()
    bad[0, 0], bad[-1, 1] = -3, E + 4
    x = torch.randn(T, H).half()
    y = run_moe(backend, x, gate, up, down, bad, probs, I, bits, gs)
    assert torch.equal(y, run_moe(backend, x, gate, up, down, bad.clamp(0, E - 1), probs, I, bits, gs))


@pytest.mark.parametrize("backend, M, dtype", cases([(1, torch.float16), (40, torch.bfloat16)]))
def test_gemm_trellis_is_deterministic(backend, M, dtype):
    # K slices (CUDA decode) and thread order (harness) must not change a single bit between calls.
    K, N, bits, gs = 1040, 200, 3, 128
    t = random_trellis(K, N, bits, gs, seed=11)
    A = torch.randn(M, K, generator=torch.Generator().manual_seed(5)).to(dtype)
    assert torch.equal(backend.gemm_trellis(A, *t, K, N, bits, gs), backend.gemm_trellis(A, *t, K, N, bits, gs))


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.id != "metal_emu"])
def test_moe_trellis_many_routed_rows(backend):
    # T * top_k = 1040 routed rows: above the CUDA one-block routing bound (TM_TRELLIS_CUDA_ROUTE_MAX_ROWS),
    # so the rows are grouped by the ATen routing there; experts get ~260 rows each (several 64-row chunks).
    T, H, I, E, top_k, bits, gs = 520, 48, 40, 4, 2, 2, 16
    gate, up, down, ids, probs = moe_case(T, H, I, E, top_k, bits, gs, "random", seed=7)
    x = (torch.randn(T, H, generator=torch.Generator().manual_seed(3)) * 0.5).half()
    y = run_moe(backend, x, gate, up, down, ids, probs, I, bits, gs)
    assert_moe_close(y, moe_reference(x, gate, up, down, ids, probs, H, I, bits, gs), torch.float16,
                     backend.exact_products)
