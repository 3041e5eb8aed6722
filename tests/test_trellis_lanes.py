"""The CUDA lane layout of trellis indices (torch_marlin/formats/trellis.py, docs/trellis.md,
"CUDA lane layout") and TrellisLinear holding its indices in either layout.

The layout is checked against a per-field reference written here from the specification (each
field read as an integer from the lane's little-endian bytes, compared with the two indices of
the canonical layout it must hold). The module checks are exact: a layout is a permutation of bits,
so every result must equal the canonical module's bit for bit.
"""

import copy

import pytest
import torch
from torch import nn

import torch_marlin as tm
from torch_marlin import planner
from torch_marlin.formats import trellis as fmt


def lane_field(lanes, s, n, lane, field, bits):
    """Field ``field`` of ``lane`` in chunk ``(s, n)``: bits ``[f*2*bits, (f+1)*2*bits)`` of the
    lane's ``8*bits`` bytes read as one little-endian integer."""
    raw = bytes(lanes[s, n, lane * 8 * bits:(lane + 1) * 8 * bits].tolist())
    return (int.from_bytes(raw, "little") >> (field * 2 * bits)) & ((1 << (2 * bits)) - 1)


def expected_field(idx, s, n, lane, field, bits):
    """The spec: field ``4*j + p`` of lane ``l`` holds rows ``r0, r0+1`` of column ``c`` of tile
    ``(8*s + j, n)``, zero for tile rows past the weight's."""
    j, p = divmod(field, 4)
    g, t = divmod(lane, 4)
    c, r0 = 2 * g + (p & 1), 4 * t + 2 * (p >> 1)
    k, col = 16 * (8 * s + j) + r0, 16 * n + c
    K, N = idx.shape

    def at(row):
        return int(idx[row, col]) if row < K and col < N else 0

    return at(k) | (at(k + 1) << bits)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("K,N", [(40, 19), (200, 77)])
def test_tiles_to_lanes_matches_the_spec_field_by_field(bits, K, N):
    g = torch.Generator().manual_seed(bits * 1000 + K)
    idx = torch.randint(0, 1 << bits, (K, N), generator=g)
    packed = fmt.pack_indices(idx, bits)
    lanes = fmt.tiles_to_lanes(packed, K, N, bits)
    tk, tn = (K + 15) // 16, (N + 15) // 16
    assert lanes.dtype == torch.uint8
    assert tuple(lanes.shape) == fmt.lanes_shape(K, N, bits) == ((tk + 7) // 8, tn, 256 * bits)
    # Every field of the last chunk (padding tile rows, the partial last tile row and column), and
    # a spread of lanes of the first chunk's first tile column.
    S = lanes.shape[0]
    for s, n, lane_list in ((S - 1, tn - 1, range(32)), (0, 0, (0, 5, 13, 22, 31))):
        for lane in lane_list:
            for field in range(32):
                got = lane_field(lanes, s, n, lane, field, bits)
                assert got == expected_field(idx, s, n, lane, field, bits), (s, n, lane, field)


def set_bits(t):
    return int(((t.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).sum())


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("K,N", [(16, 16), (40, 19), (200, 77), (256, 48)])
def test_lanes_round_trip_keeps_padding(bits, K, N):
    g = torch.Generator().manual_seed(bits + K + N)
    tk, tn = (K + 15) // 16, (N + 15) // 16
    # Random bytes everywhere, edge tiles' padding included: the layout is a bit permutation.
    packed = torch.randint(0, 256, (tk, tn, 32 * bits), dtype=torch.uint8, generator=g)
    lanes = fmt.tiles_to_lanes(packed, K, N, bits)
    assert torch.equal(fmt.lanes_to_tiles(lanes, K, N, bits), packed)
    # Each chunk holds its tiles' bits: as many set bits, and none for the zero tile rows past tk.
    assert set_bits(lanes) == set_bits(packed)


def test_conversion_in_several_steps_equals_one(monkeypatch):
    K, N, bits = 1000, 40, 3  # 63 tile rows: 8 chunks
    packed = fmt.pack_indices(torch.randint(0, 8, (K, N), generator=torch.Generator().manual_seed(1)), bits)
    whole = fmt.tiles_to_lanes(packed, K, N, bits)
    monkeypatch.setattr(fmt, "_CHUNK_BYTES_PER_STEP", 1)
    assert torch.equal(fmt.tiles_to_lanes(packed, K, N, bits), whole)
    assert torch.equal(fmt.lanes_to_tiles(whole, K, N, bits), packed)


def test_bad_input_names_the_argument():
    K, N, bits = 40, 19, 3
    packed = fmt.pack_indices(torch.zeros(K, N, dtype=torch.int64), bits)
    lanes = fmt.tiles_to_lanes(packed, K, N, bits)
    with pytest.raises(ValueError, match=r"packed must be uint8 of shape \(3, 2, 96\)"):
        fmt.tiles_to_lanes(packed[:, :1], K, N, bits)
    with pytest.raises(ValueError, match="packed must be uint8"):
        fmt.tiles_to_lanes(packed.int(), K, N, bits)
    with pytest.raises(ValueError, match="packed must be a uint8 tensor"):
        fmt.tiles_to_lanes(packed.numpy(), K, N, bits)
    with pytest.raises(ValueError, match=r"lanes must be uint8 of shape \(1, 2, 768\)"):
        fmt.lanes_to_tiles(packed, K, N, bits)
    with pytest.raises(ValueError, match="lanes must be uint8"):
        fmt.lanes_to_tiles(lanes.to(torch.int16), K, N, bits)
    with pytest.raises(ValueError, match="bits must be one of"):
        fmt.tiles_to_lanes(packed, K, N, 5)
    with pytest.raises(ValueError, match="K must be a positive int"):
        fmt.lanes_shape(0, N, bits)
    with pytest.raises(ValueError, match="N must be a positive int"):
        fmt.lanes_to_tiles(lanes, K, 19.0, bits)


# ---- TrellisLinear in either layout -------------------------------------------------------------

def make_pair(K=200, N=48, bits=3, bias=True, dtype=torch.float32):
    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=bias).to(dtype)
    tiles = tm.TrellisLinear.from_linear(lin, bits=bits, group_size=32)
    lanes = copy.deepcopy(tiles)
    lanes._set_index_layout("lanes")
    return tiles, lanes


def test_module_forced_to_lanes_on_cpu_matches_tiles():
    tiles, lanes = make_pair()
    assert tiles.index_layout == "tiles" and lanes.index_layout == "lanes"
    assert tuple(lanes.packed_indices.shape) == fmt.lanes_shape(200, 48, 3)
    assert torch.equal(lanes.canonical_indices(), tiles.packed_indices)
    lanes.validate()
    sd_tiles, sd_lanes = tiles.state_dict(), lanes.state_dict()
    assert sd_lanes.keys() == sd_tiles.keys()
    assert all(torch.equal(sd_lanes[k], sd_tiles[k]) for k in sd_tiles)
    assert lanes.index_layout == "lanes"  # saving converts a copy, not the buffer
    assert torch.equal(lanes.dequantized_weight(), tiles.dequantized_weight())
    # forward never changes the layout: lanes on the CPU raise, until use_device_layout() sets the
    # CPU's canonical tiles.
    x = torch.randn(2, 3, 200)
    with pytest.raises(ValueError, match="CUDA lane layout"):
        lanes(x)
    assert lanes.index_layout == "lanes"
    lanes.use_device_layout()
    assert lanes.index_layout == "tiles" and torch.equal(lanes.packed_indices, tiles.packed_indices)
    assert torch.equal(lanes(x), tiles(x))
    with pytest.raises(ValueError, match="layout must be 'tiles' or 'lanes'"):
        lanes._set_index_layout("rows")


MOVES = {"to_cpu": lambda m: m.to("cpu"), "cpu": lambda m: m.cpu(), "float": lambda m: m.float(),
         "half": lambda m: m.half()}


@pytest.mark.parametrize("move", MOVES)
def test_module_moves_keep_the_layout_until_use_device_layout(move):
    tiles, lanes = make_pair()
    moved = MOVES[move](lanes)
    MOVES[move](tiles)
    assert moved is lanes and lanes.index_layout == "lanes"
    assert torch.equal(lanes.canonical_indices(), tiles.packed_indices)
    lanes.use_device_layout()
    assert lanes.index_layout == "tiles" and torch.equal(lanes.packed_indices, tiles.packed_indices)
    assert torch.equal(lanes.dequantized_weight(), tiles.dequantized_weight())


def test_tiles_state_dict_loads_into_a_lanes_module():
    tiles, lanes = make_pair(bias=False)
    fresh = tm.TrellisLinear(200, 48, bits=3, group_size=32, bias=False)
    fresh._set_index_layout("lanes")
    fresh.load_state_dict(tiles.state_dict())
    # Loaded, validated, then set to the CPU's layout.
    assert fresh.index_layout == "tiles" and torch.equal(fresh.packed_indices, tiles.packed_indices)
    x = torch.randn(5, 200)
    assert torch.equal(fresh(x), tiles(x))
    # A lanes module's own state dict loads back the same way, and bad tensors still fail validation.
    lanes.load_state_dict(lanes.state_dict())
    assert torch.equal(lanes.packed_indices, tiles.packed_indices)
    lanes._set_index_layout("lanes")
    bad = {k: v.clone() for k, v in tiles.state_dict().items()}
    bad["grid"][0] = float("nan")
    with pytest.raises(ValueError, match="grid contains non-finite"):
        lanes.load_state_dict(bad)
    bad = dict(tiles.state_dict(), packed_indices=fmt.tiles_to_lanes(tiles.packed_indices, 200, 48, 3))
    with pytest.raises(RuntimeError, match="packed_indices"):
        lanes.load_state_dict(bad)


def test_policy_applies_at_construction_move_and_load(monkeypatch):
    """With a policy that asks for lanes on the CPU (what CUDA asks for), the module holds lanes after
    from_linear, moves and loads, while its state dict and weights stay canonical."""
    tiles, _ = make_pair()
    calls = []

    def lanes_everywhere(K, N, bits, device):
        calls.append((K, N, bits, torch.device(device).type))
        return "lanes"

    monkeypatch.setattr(planner, "trellis_index_layout", lanes_everywhere, raising=False)
    torch.manual_seed(0)
    m = tm.TrellisLinear.from_linear(nn.Linear(200, 48), bits=3, group_size=32)
    assert m.index_layout == "lanes" and calls == [(200, 48, 3, "cpu")]
    assert torch.equal(m.canonical_indices(), tiles.canonical_indices())
    m.float()
    assert m.index_layout == "lanes" and len(calls) == 1  # the layout is cached per device
    assert torch.equal(m.state_dict()["packed_indices"], tiles.canonical_indices())
    fresh = tm.TrellisLinear(200, 48, bits=3, group_size=32)
    assert fresh.index_layout == "tiles"  # the constructor leaves the canonical zeros
    fresh.load_state_dict(m.state_dict())
    assert fresh.index_layout == "lanes" and torch.equal(fresh.packed_indices, m.packed_indices)
    assert torch.equal(fresh.dequantized_weight(), tiles.dequantized_weight())


def test_fusing_members_in_either_layout():
    from torch_marlin.registry import LAYER_FORMATS
    torch.manual_seed(0)
    lins = [nn.Linear(64, 48, bias=False) for _ in range(3)]
    first = LAYER_FORMATS["trellis"].quantize(lins[0], 32, torch.float32, rotate=False)
    parts = [first] + [LAYER_FORMATS["trellis"].quantize(lin, 32, torch.float32, grid=first.grid, rotate=False)
                       for lin in lins[1:]]
    reference, reason = LAYER_FORMATS["trellis"].concat(parts)
    assert reason is None
    parts[0]._set_index_layout("lanes")
    parts[2]._set_index_layout("lanes")
    fused, reason = LAYER_FORMATS["trellis"].concat(parts)
    assert reason is None and fused.index_layout == "tiles"
    assert torch.equal(fused.packed_indices, reference.packed_indices)


def test_patched_fused_model_in_lanes_matches():
    from tiny_models import tiny_model

    model = tiny_model("llama", layers=1)
    tm.patch_model(model, format="trellis", group_size=32, progress=False, fuse=True, rotate=False)
    fused = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(fused, tm.TrellisLinear)
    ids = torch.randint(0, 128, (2, 3), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(ids).logits
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fused._set_index_layout("lanes")
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="CUDA lane layout"), torch.inference_mode():
        model(ids)
    tm.registry.use_device_layouts(model)
    assert fused.index_layout == "tiles"
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_conversion_and_module_moves(monkeypatch):
    K, N, bits = 200, 48, 3
    packed = fmt.pack_indices(torch.randint(0, 8, (K, N), generator=torch.Generator().manual_seed(2)), bits)
    lanes = fmt.tiles_to_lanes(packed.cuda(), K, N, bits)
    assert lanes.is_cuda and torch.equal(lanes.cpu(), fmt.tiles_to_lanes(packed, K, N, bits))
    assert torch.equal(fmt.lanes_to_tiles(lanes, K, N, bits).cpu(), packed)
    tiles, _ = make_pair(K, N, bits)
    # A policy asking for lanes on CUDA only: use_device_layout() after .cuda() converts there, after
    # .cpu() back.
    monkeypatch.setattr(planner, "trellis_index_layout",
                        lambda K, N, bits, device: "lanes" if torch.device(device).type == "cuda" else "tiles",
                        raising=False)
    m = copy.deepcopy(tiles).cuda()
    assert m.packed_indices.is_cuda and m.index_layout == "tiles"
    m.use_device_layout()
    assert m.index_layout == "lanes"
    assert torch.equal(m.packed_indices.cpu(), fmt.tiles_to_lanes(tiles.packed_indices, K, N, bits))
    assert torch.equal(m.state_dict()["packed_indices"].cpu(), tiles.packed_indices)
    assert torch.equal(m.dequantized_weight().cpu(), tiles.dequantized_weight())
    m.cpu()
    m.use_device_layout()
    assert m.index_layout == "tiles" and torch.equal(m.packed_indices, tiles.packed_indices)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_module_runs_the_lane_kernels(dtype):
    # The planner's policy puts a layer with K % 8 == 0 in the lane layout on CUDA; its decode and
    # prefill outputs equal the forward's own steps on the canonical indices (the kernels form the
    # same products in the same order).
    K, N = 264, 80
    tiles, _ = make_pair(K=K, N=N, bits=3, dtype=dtype)
    model = copy.deepcopy(tiles).cuda()
    model.use_device_layout()
    assert model.index_layout == "lanes"
    packed = tiles.packed_indices.cuda()
    torch.manual_seed(1)
    for rows in (1, 7, 16, 40):
        x = torch.randn(2, rows, K, device="cuda", dtype=dtype)
        with torch.inference_mode():
            got = model(x)
            x2 = fmt.rotate_input(x.reshape(-1, K).float(), model.su).to(dtype)
            y = torch.ops.marlin.gemm_trellis(x2, packed, model.scales, model.grid, model.su, model.sv, K, N, 3, 32)
            want = fmt.rotate_output(y.float(), model.sv).to(dtype) + model.bias.to(dtype)
        assert model.index_layout == "lanes"
        assert torch.equal(got.reshape(-1, N), want)
