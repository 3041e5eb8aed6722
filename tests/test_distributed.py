"""Tensor parallelism (torch_marlin/distributed/): the sharding rules against the whole layer in one
process, then two gloo ranks spawned by the test running a small Llama-shaped model against the
same model in one process."""

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import torch_marlin
from torch_marlin.distributed import ShardError, shard_layer
from torch_marlin.distributed.bench import free_port, random_quantized_layer

pytest.importorskip("transformers")

WORLD = 2
FORMATS = ("fp4", "u4", "affine", "trellis")
GROUP = 64
# hidden 256: the trellis rotation works in Hadamard blocks of 128, so each of the two ranks must hold
# at least 128 features of every split dimension (k/v: 4 heads of 64).
SHAPE = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False)
# A float checkpoint quantized while loading (quantizing takes seconds per layer on the CPU: smaller).
SMALL = dict(SHAPE, hidden_size=128, intermediate_size=256, vocab_size=256)
# fp32 everywhere: a row-parallel layer sums two fp32 partial products of K/2 terms where the whole
# layer sums K terms in one order, a reassociation worth a few ulps of the largest partial sum per
# layer (K <= 512: relative 512 * 2**-24 ~ 3e-5 at worst, ~1e-6 typically). Two decoder layers and
# the norms keep that well under 1e-4 relative to the logits' scale; a wrong shard (a column or a
# group off, a bias added twice) moves logits by their own magnitude.
RTOL = 1e-4


def random_layer(fmt: str, lin: nn.Linear, gen: torch.Generator) -> nn.Module:
    """A quantized layer of ``lin``'s shape with random codes and scales (quantizing is what other
    tests check; here only the sharding of whatever the layer holds matters)."""
    return random_quantized_layer(fmt, lin, GROUP, gen)


def random_model(fmt: str, seed: int = 0, bias: bool = False):
    """A Llama-shaped model whose decoder projections are random ``fmt`` layers (lm_head in float)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(attention_bias=bias, mlp_bias=bias, **SHAPE)).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, mod in list(model.model.layers.named_modules()):
        if isinstance(mod, nn.Linear):
            parent, _, child = name.rpartition(".")
            setattr(model.model.layers.get_submodule(parent), child, random_layer(fmt, mod, gen))
    return model


def greedy(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        for _ in range(new_tokens):
            logits = model(ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    return ids


def logits_of(model, ids):
    with torch.inference_mode():
        return model(ids, use_cache=False).logits


def assert_logits_close(out, ref, what):
    err = (out - ref).abs().max().item()
    assert err <= RTOL * ref.abs().max().item(), f"{what}: logits differ by {err} (scale {ref.abs().max().item()})"


# ---------------------------------------------------------------------------------------------- one process

def _ranks_output(layer, x, style, world=WORLD, splits=None, local_float=False):
    """The layer's output rebuilt from every rank's shard, as the collectives would."""
    if style == "rowwise":
        K = layer.in_features
        return sum(shard_layer(layer, "rowwise", r, world, local_float=local_float)(
            x[:, r * K // world:(r + 1) * K // world]) for r in range(world))
    outs = [shard_layer(layer, "colwise", r, world, splits=splits, local_float=local_float)(x) for r in range(world)]
    if splits is None:
        return torch.cat(outs, -1)
    per = [s // world for s in splits]
    pieces = [o.split(per, -1) for o in outs]  # rank r holds its part of every member
    return torch.cat([pieces[r][i] for i in range(len(splits)) for r in range(world)], -1)


@pytest.mark.parametrize("fmt", FORMATS + ("rans", "float"))
@pytest.mark.parametrize("style", ("colwise", "rowwise"))
def test_shards_compute_their_part(fmt, style):
    gen = torch.Generator().manual_seed(1)
    lin = nn.Linear(256, 256, bias=True)
    layer = lin if fmt == "float" else random_layer("fp4" if fmt == "rans" else fmt, lin, gen)
    if fmt == "rans":
        layer = torch_marlin.RansLinear.from_marlin(layer)
    x = torch.randn(3, 256, generator=gen)
    with torch.inference_mode():
        ref = layer(x)
        out = _ranks_output(layer, x, style, local_float=fmt == "float")
    # colwise shards compute the same dot products as the whole layer (equal); rowwise splits each into
    # two fp32 partial sums (see RTOL).
    assert_logits_close(out, ref, f"{fmt} {style}")
    shard = shard_layer(layer, style, 1, WORLD, local_float=fmt == "float")
    assert type(shard) is type(layer)
    if style == "rowwise":  # the bias is added once
        assert shard.bias is None and shard_layer(layer, style, 0, WORLD, local_float=fmt == "float").bias is not None


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_half_precision_shards(dtype):
    gen = torch.Generator().manual_seed(7)
    layer = random_layer("affine", nn.Linear(256, 128, bias=True, dtype=dtype), gen)
    x = torch.randn(2, 3, 256, generator=gen).to(dtype)  # leading batch dimensions
    with torch.inference_mode():
        ref = layer(x)
        assert torch.equal(_ranks_output(layer, x.reshape(6, 256), "colwise").reshape(2, 3, 128), ref)
        rows = _ranks_output(layer, x.reshape(6, 256), "rowwise").reshape(2, 3, 128)
    # Each rank rounds its fp32 partial sum to the 16-bit dtype before the sum: two roundings of
    # half an ulp of the output's magnitude more than the whole layer's one.
    ulp = torch.finfo(dtype).eps * ref.float().abs().amax()
    assert (rows.float() - ref.float()).abs().max() <= 2 * ulp


@pytest.mark.parametrize("fmt", ("u4", "trellis"))
def test_fused_layer_splits_per_member(fmt):
    gen = torch.Generator().manual_seed(2)
    members = (256, 128, 128) if fmt == "u4" else (256, 256)
    layer = random_layer(fmt, nn.Linear(256, sum(members), bias=fmt == "u4"), gen)
    x = torch.randn(2, 256, generator=gen)
    with torch.inference_mode():
        assert torch.equal(_ranks_output(layer, x, "colwise", splits=members), layer(x))
    with pytest.raises(ValueError, match="must sum to out_features"):
        shard_layer(layer, "colwise", 0, WORLD, splits=(256, 128))


def test_act_order_rows_regrouped_per_rank():
    gen = torch.Generator().manual_seed(3)
    layer = random_layer("u4", nn.Linear(256, 64), gen)
    ordered = torch_marlin.MarlinLinear(256, 64, format="u4", group_size=GROUP, dtype=torch.float32, act_order=True)
    ordered.load_state_dict(dict(layer.state_dict(), input_perm=torch.arange(256)))
    # Groups stored in the order (rank 1, rank 0, rank 1, rank 0), rows shuffled within each rank's slice.
    halves = torch.cat([torch.randperm(128, generator=gen), torch.randperm(128, generator=gen) + 128])
    ordered.input_perm.copy_(halves.view(4, GROUP)[torch.tensor([2, 0, 3, 1])].reshape(-1))
    x = torch.randn(3, 256, generator=gen)
    with torch.inference_mode():
        assert_logits_close(_ranks_output(ordered, x, "rowwise"), ordered(x), "act-order rowwise")
        assert torch.equal(_ranks_output(ordered, x, "colwise"), ordered(x))
    ordered.input_perm.copy_(torch.randperm(256, generator=gen))  # GPTQ desc_act: groups span both slices
    with pytest.raises(ShardError, match="act-order group.*column-parallel"):
        shard_layer(ordered, "rowwise", 0, WORLD, name="mlp.down_proj")


def test_save_quantized_refuses_a_sharded_model(tmp_path):
    from torch_marlin.distributed import shard_in_place

    model = random_model("fp4")
    name = "model.layers.1.self_attn.q_proj"
    shard_in_place(model.get_submodule(name), "colwise", 1, WORLD, name=name)
    with pytest.raises(ValueError, match=rf"{name} is a tensor-parallel shard \(colwise, rank 1 of 2\).*one-process"):
        torch_marlin.save_quantized(model, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_refusals_name_layer_dimension_and_world_size():
    gen = torch.Generator().manual_seed(4)
    with pytest.raises(ShardError, match=r"q_proj: out_features=200 does not split over world size 3"):
        shard_layer(random_layer("fp4", nn.Linear(128, 200), gen), "colwise", 0, 3, name="q_proj")
    # 192 / 2 = 96 rows: not whole groups of 64
    with pytest.raises(ShardError, match=r"o_proj: in_features=192 .* world size 2.*group_size=64"):
        shard_layer(random_layer("u4", nn.Linear(192, 64), gen), "rowwise", 0, 2, name="o_proj")
    trellis = random_layer("trellis", nn.Linear(256, 128), gen)  # output rotation blocks of 128 over 2 ranks
    with pytest.raises(ShardError, match=r"k_proj: the output rotation .* blocks of 128.*rotate=False"):
        shard_layer(trellis, "colwise", 0, 2, name="k_proj")
    moe = torch_marlin.TrellisMoE(128, 128, 4, top_k=2, group_size=64)
    with pytest.raises(ShardError, match="leave the MoE block out of the tensor-parallel plan"):
        shard_layer(moe, "colwise", 0, 2, name="mlp")
    with pytest.raises(TypeError, match="tp_plan must be 'auto' or a dict"):
        torch_marlin.from_pretrained(os.path.dirname(__file__), tp_plan="colwise")
    with pytest.raises(ValueError, match="style must be one of"):
        shard_layer(random_layer("fp4", nn.Linear(128, 64), gen), "diagonal", 0, 2)


# ---------------------------------------------------------------------------------------------- two ranks

def _worker(rank, world, port, workdir):
    import datetime
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from torch_marlin.distributed import QuantizedColwiseParallel, QuantizedRowwiseParallel, parallelize
    from torch_marlin.fusion import fuse_projections

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "Passing `tp_plan` directly", FutureWarning)  # the spelling, kept
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # as torchrun sets them
    # A rank that fails ends the test through mp.spawn; a minute bounds a wait on a collective.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (world,))
        ref = torch.load(os.path.join(workdir, "reference.pt"))
        ids = ref["ids"]
        user_plan = {"model.layers.*.self_attn.q_proj": QuantizedColwiseParallel(),
                     "model.layers.*.self_attn.k_proj": QuantizedColwiseParallel(),
                     "model.layers.*.self_attn.v_proj": QuantizedColwiseParallel(),
                     "model.layers.*.self_attn.o_proj": QuantizedRowwiseParallel(),
                     # PyTorch's own styles, as a plan written for the float model has them
                     "model.layers.*.mlp.gate_proj": ColwiseParallel(),
                     "model.layers.*.mlp.up_proj": ColwiseParallel(),
                     "model.layers.*.mlp.down_proj": RowwiseParallel()}
        for fmt in FORMATS:
            directory = os.path.join(workdir, fmt)
            # A user's own plan through parallelize_module (here via parallelize, which also makes the
            # config's head counts per rank).
            if fmt in ("u4", "trellis"):  # the same styles as from_pretrained below: two formats suffice here
                model = parallelize(torch_marlin.load_quantized(directory), mesh, user_plan)
                q = model.model.layers[0].self_attn.q_proj
                assert q.out_features == SHAPE["hidden_size"] // world, f"{fmt}: q_proj not sharded"
                assert_logits_close(logits_of(model, ids), ref[fmt]["logits"], f"{fmt} rank {rank} (own plan)")
                if fmt == "u4":  # fused after sharding: each rank fuses its own shards of q/k/v and gate/up
                    fused, _ = fuse_projections(model)
                    assert len(fused) == 2 * SHAPE["num_hidden_layers"], fused
                    assert_logits_close(logits_of(model, ids), ref[fmt]["logits"], f"fused u4 rank {rank}")
            if fmt == "fp4":  # the same model entropy-coded: RansLinear shards
                model = torch_marlin.load_quantized(directory)
                torch_marlin.entropy_code(model, progress=False)
                parallelize(model, mesh, user_plan)
                assert type(model.model.layers[0].mlp.down_proj).__name__ == "RansLinear"
                assert_logits_close(logits_of(model, ids), ref[fmt]["logits"], f"rans rank {rank}")
            # The checkpoint read in pieces (safetensors get_slice), the model's own plan.
            model = torch_marlin.from_pretrained(directory, tp_plan="auto")
            down = model.model.layers[1].mlp.down_proj
            assert down.in_features == SHAPE["intermediate_size"] // world
            assert (down.bias is not None) == (rank == 0 and fmt == "u4")
            assert_logits_close(logits_of(model, ids), ref[fmt]["logits"], f"{fmt} rank {rank} (from_pretrained)")
            assert torch.equal(greedy(model, ids, 4), ref[fmt]["tokens"]), f"{fmt} rank {rank}: greedy tokens differ"
        # transformers' own tp_plan, through the quantizer's hooks: a torch_marlin checkpoint, each rank
        # reading its pieces, and a float checkpoint quantized on load (each rank quantizes its shard).
        from transformers import AutoModelForCausalLM

        for fmt in ("fp4", "trellis"):
            model = AutoModelForCausalLM.from_pretrained(os.path.join(workdir, fmt), tp_plan="auto")
            assert model.model.layers[0].mlp.gate_proj.out_features == SHAPE["intermediate_size"] // world
            assert_logits_close(logits_of(model, ids), ref[fmt]["logits"], f"{fmt} rank {rank} (transformers)")
        model = AutoModelForCausalLM.from_pretrained(os.path.join(workdir, "float"), tp_plan="auto",
                                                     quantization_config=torch_marlin.TorchMarlinConfig(
                                                         format="u4", group_size=GROUP))
        down = model.model.layers[0].mlp.down_proj
        assert isinstance(down, torch_marlin.MarlinLinear) and down.in_features == SMALL["intermediate_size"] // world
        try:  # o_proj's row shard (64 of 128 inputs) would cut groups of 128
            AutoModelForCausalLM.from_pretrained(os.path.join(workdir, "float"), tp_plan="auto",
                                                 quantization_config=torch_marlin.TorchMarlinConfig(group_size=128))
        except ShardError as e:
            assert "model.layers.0.self_attn.o_proj: a row shard of in_features=128 over world size 2" in str(e), str(e)
        else:
            raise AssertionError("transformers' tp_plan cut quantization groups")
        assert_logits_close(logits_of(model, ids), ref["float_u4"], f"u4 on load rank {rank} (transformers)")
        assert torch.equal(greedy(model, ids, 4), ref["float_u4_tokens"]), f"rank {rank}: greedy tokens differ"
        out = os.path.join(workdir, f"saved_by_rank_{rank}")
        try:  # each rank holds its shards only
            torch_marlin.save_quantized(model, out)
        except ValueError as e:
            assert "is a tensor-parallel shard" in str(e) and f"rank {rank} of {world}" in str(e), str(e)
        else:
            raise AssertionError("save_quantized wrote one rank's shards as a model")
        assert not os.path.exists(out)
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                model.save_pretrained(out)
            except ValueError as e:
                assert "not serializable" in str(e), str(e)
            else:
                raise AssertionError("save_pretrained wrote one rank's shards as a model")
        assert any("loaded tensor-parallel" in str(w.message) for w in caught), [str(w.message) for w in caught]
        # scripts/bench_e2e.py --tp: each rank's part of the comparison, on these ranks.
        import sys

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
        import bench_e2e

        from torch_marlin.distributed.bench import _rank_main

        args = bench_e2e.build_parser().parse_args(
            ["--tp", "2", "--device", "cpu", "--layers", "1", "--hidden", "256", "--intermediate", "512", "--heads",
             "4", "--kv-heads", "4", "--vocab", "256", "--prompt", "2", "--new-tokens", "3", "--batch", "1",
             "--formats", "float,fp4", "--group-size", "64", "--modes", "eager"])
        rows = _rank_main(rank, args, bench_e2e.build_model, bench_e2e.llama_config, bench_e2e.time_generation)
        if rank == 0:
            assert [(r[0], r[1], r[2], r[3]) for r in rows] == [(f, "eager", 1, n) for f in ("float32", "fp4")
                                                               for n in (1, 2)], rows
            assert all(r[4] > 0 and r[5] > 0 and (r[6] > 0) == (r[3] == 2) for r in rows), rows
        # Layouts other than the defaults: a gathered column output, a row layer fed the whole input,
        # a reduce-scattered row output (sequence parallel), a DTensor input.
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

        def make():
            torch.manual_seed(8)  # nn.Linear's bias, which the random layer keeps
            return nn.Sequential(random_layer("u4", nn.Linear(256, 128), torch.Generator().manual_seed(8)))

        whole = make()
        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(9))
        with torch.inference_mode():
            ref_y = whole(x)
        cases = ((QuantizedColwiseParallel(output_layouts=Replicate()), x, ref_y),
                 (QuantizedRowwiseParallel(input_layouts=Replicate()), x, ref_y),
                 (QuantizedRowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)), x,
                  ref_y.chunk(world)[rank]),
                 (QuantizedColwiseParallel(use_local_output=False), distribute_tensor(x, mesh, [Replicate()]),
                  ref_y))
        for style, inp, want in cases:
            layer = make()
            parallelize(layer, mesh, {"0": style})
            with torch.inference_mode():
                y = layer(inp)
            y = y.full_tensor() if isinstance(y, DTensor) else y
            assert_logits_close(y, want, f"{style} rank {rank}")
        # Shapes that do not divide: refused before anything is sharded, naming layer, dimension, world size.
        odd = nn.Sequential(torch_marlin.MarlinLinear(64, 101, format="fp4", group_size=64, dtype=torch.float32))
        try:
            parallelize(odd, mesh, {"0": QuantizedColwiseParallel()})
        except ShardError as e:
            assert "0: out_features=101 does not split over world size 2" in str(e), str(e)
        else:
            raise AssertionError("a 101-column layer was split over 2 ranks")
        assert odd[0].out_features == 101
        fused = torch_marlin.load_quantized(os.path.join(workdir, "u4"))
        fuse_projections(fused)
        try:
            parallelize(fused, mesh, user_plan)
        except ValueError as e:
            assert "q_proj is a slice of the fused layer" in str(e) and "before fusing" in str(e), str(e)
        else:
            raise AssertionError("a fused model was sharded through its slices")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_one_process(tmp_path):
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(5))
    ref = {"ids": ids}
    for fmt in FORMATS:
        model = random_model(fmt, bias=fmt == "u4")
        torch_marlin.save_quantized(model, str(tmp_path / fmt))
        ref[fmt] = {"logits": logits_of(model, ids), "tokens": greedy(model, ids, 4)}
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(6)
    LlamaForCausalLM(LlamaConfig(**SMALL)).save_pretrained(tmp_path / "float")
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=torch_marlin.TorchMarlinConfig(format="u4", group_size=GROUP))
    ref["float_u4"], ref["float_u4_tokens"] = logits_of(quantized, ids), greedy(quantized, ids, 4)
    torch.save(ref, tmp_path / "reference.pt")
    mp.spawn(_worker, args=(WORLD, free_port(), str(tmp_path)), nprocs=WORLD, join=True)
