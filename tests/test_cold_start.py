"""Cold start in seconds (issue #38), decided on CPU: the default launch takes one config
(the shipped table's, else a heuristic that fits shared memory) on a plain Triton kernel
with no autotuner; autotuning only on request, over at most 3 configs pruned by shared
memory; fp32 that would be plain fp32 on CUDA leaves Triton; a new expert count does not
recompile; set-up warms only what a step launches; the routing warm-up runs only where a
prediction reads it, on the torch expert loop, under the run's autocast."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from lightning_hetermoe.kernels import tiles, tuning
from lightning_hetermoe.kernels.availability import triton_runs_dtype
from lightning_hetermoe.kernels.tiles import Tile
from lightning_hetermoe.kernels.warmup import LayerShape, warm_up_keys
from lightning_hetermoe.plan import Plan, ZPGroup

triton = pytest.importorskip("triton")

H100_SMEM = 232448  # shared_memory_per_block_optin of an H100
CAPS = sorted(tuning.SMEM_OPTIN)
HALF = (torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def autotune_follows_env(monkeypatch):
    monkeypatch.delenv(tuning.ENV, raising=False)
    tuning.enable_autotune(None)
    yield
    tuning.enable_autotune(None)


def cuda_kernel(monkeypatch, which="gemm", dtype=torch.bfloat16, bucket=4096):
    from lightning_hetermoe.kernels import launch, triton_src

    monkeypatch.setattr(launch, "_device", lambda index: ((9, 0), H100_SMEM, "cuda:sm90"))
    fn = triton_src.grouped_gemm_kernel if which == "gemm" else triton_src.grouped_wgrad_kernel
    return launch._kernel(fn, which, torch.device("cuda", 0), dtype, bucket)


# ---- 1. no autotuning by default -----------------------------------------------------------
@pytest.mark.parametrize("which", ["gemm", "wgrad"])
def test_default_cuda_launch_is_a_plain_kernel_with_one_config(which, monkeypatch):
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    fn, kwargs = cuda_kernel(monkeypatch, which)
    assert isinstance(fn, JITFunction) and not isinstance(fn, Autotuner)
    want = tuning.tile_for((9, 0), torch.bfloat16, which, 4096, H100_SMEM)
    assert kwargs == want.launch_kwargs()
    assert set(kwargs) == {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP", "num_warps", "num_stages"}


def test_autotuning_only_on_request(monkeypatch):
    from triton.runtime.autotuner import Autotuner

    assert not tuning.autotune_enabled()
    monkeypatch.setenv(tuning.ENV, "1")
    assert tuning.autotune_enabled()
    fn, kwargs = cuda_kernel(monkeypatch)
    assert isinstance(fn, Autotuner) and kwargs == {}
    assert fn.cache_results, "tunings go to Triton's disk cache"
    assert len(fn.configs) <= tuning.MAX_CANDIDATES
    tuning.enable_autotune(False)  # the function wins over the env var
    assert not tuning.autotune_enabled()
    monkeypatch.delenv(tuning.ENV)
    with tuning.autotuning(True):
        assert tuning.autotune_enabled()
    assert not tuning.autotune_enabled()


# ---- the table and the heuristic -----------------------------------------------------------
@pytest.mark.parametrize("capability", CAPS, ids=[f"sm{a}{b}" for a, b in CAPS])
def test_every_default_fits_its_shared_memory(capability):
    budget = tuning.smem_budget(capability)
    for dtype in (*HALF, torch.float32):
        elem = torch.empty(0, dtype=dtype).element_size()
        for which in ("gemm", "wgrad"):
            for bucket in tuning.tuning_buckets():
                t = tuning.default_tile(capability, dtype, which, bucket)
                assert t.smem_bytes(which, elem) <= budget, (capability, dtype, which, bucket, t)
                assert min(t.block_m, t.block_n, t.block_k) >= 16


def test_heuristic_small_buckets_take_64_row_tiles():
    for cap in ((8, 0), (9, 0)):
        small = tuning.default_tile(cap, torch.bfloat16, "gemm", 512)
        large = tuning.default_tile(cap, torch.bfloat16, "gemm", 8192)
        assert (small.block_m, large.block_m) == (64, 128)
    volta = [tuning.default_tile(c, torch.float16, "gemm", b) for c in ((7, 0), (7, 5)) for b in (256, 16384)]
    assert all(t.block_m <= 128 and t.block_n <= 64 and t.num_stages == 2 for t in volta)
    # fp32 (TF32) takes no more shared memory than bf16: not bf16 tiles at twice the bytes
    for which in ("gemm", "wgrad"):
        b = tuning.default_tile((9, 0), torch.bfloat16, which, 8192)
        f = tuning.default_tile((9, 0), torch.float32, which, 8192)
        assert f.smem_bytes(which, 4) <= b.smem_bytes(which, 2)


def test_a_table_entry_overrides_the_heuristic_and_bad_ones_fall_back():
    entry = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 2, "num_stages": 3}
    table = {"cuda:sm90": {"bf16": {"gemm": {"1024": entry, "2048": {**entry, "BLOCK_M": 48},
                                             "4096": {**entry, "num_warps": "4"}, "8192": [32, 64, 64, 3, 2],
                                             "16384": {**entry, "BLOCK_N": 4096}}}}}
    heuristic = tuning.default_tile((9, 0), torch.bfloat16, "gemm", 1024)
    assert tuning.tile_for((9, 0), torch.bfloat16, "gemm", 1024, table=table) == Tile(32, 64, 64, 3, 2) != heuristic
    for bucket in (2048, 4096, 8192):  # not a power of two, a string, not an object
        assert tuning.tile_for((9, 0), torch.bfloat16, "gemm", bucket, table=table) == \
            tuning.default_tile((9, 0), torch.bfloat16, "gemm", bucket)
    # 16384: valid but (64*64 + 64*4096) * 2 B * 3 stages exceeds 227 KiB
    assert tuning.tile_for((9, 0), torch.bfloat16, "gemm", 16384, table=table) == \
        tuning.default_tile((9, 0), torch.bfloat16, "gemm", 16384)
    # other kinds, dtypes, kernels and buckets are not touched by the entry
    assert tuning.tile_for((8, 0), torch.bfloat16, "gemm", 1024, table=table) == \
        tuning.default_tile((8, 0), torch.bfloat16, "gemm", 1024)
    assert tuning.tile_for((9, 0), torch.float16, "gemm", 1024, table=table) == \
        tuning.default_tile((9, 0), torch.float16, "gemm", 1024)
    assert tuning.tile_for((9, 0), torch.bfloat16, "gemm", 512, table={"cuda:sm90": "junk"}) == \
        tuning.default_tile((9, 0), torch.bfloat16, "gemm", 512)


def test_the_shipped_table_is_read_lazily_and_a_missing_one_falls_back(monkeypatch):
    monkeypatch.setattr(tiles, "_LOADED", [])
    shipped = tiles.load()
    assert isinstance(shipped, dict) and all(k.startswith("_") for k in shipped), \
        "no GPU measurement yet: the shipped table holds no GPU entries"
    monkeypatch.setattr(tiles, "_LOADED", [])
    monkeypatch.setattr(tiles, "FILE", "no-such-table.json")
    assert tiles.load() == {}
    assert tuning.tile_for((9, 0), torch.bfloat16, "wgrad", 512) == \
        tuning.default_tile((9, 0), torch.bfloat16, "wgrad", 512)


def test_a_table_entry_may_name_its_launch_order():
    entry = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
    assert tiles.parse(entry) == Tile(64, 128, 64, 4, 4, tiles.DEFAULT_GROUP)
    assert tiles.parse({**entry, "GROUP": 1}) == Tile(64, 128, 64, 4, 4, 1)
    for bad in (0, tiles.MAX_GROUP + 1, "8", True, 2.5):
        assert tiles.parse({**entry, "GROUP": bad}) is None, bad
    tile = Tile(64, 128, 64, 4, 4, 16)
    assert tiles.parse(tile.to_json()) == tile and tuning.as_config(tile).kwargs["GROUP"] == 16


def test_written_entries_keep_other_kinds():
    table = {"_about": "x", "cuda:sm80": {"bf16": {"gemm": {"256": Tile(64, 64, 32, 2, 4).to_json()}}}}
    out = tiles.with_entries(table, "cuda:sm90", {("bf16", "gemm", 512): Tile(64, 128, 64, 4, 4)})
    assert out["cuda:sm80"] == table["cuda:sm80"] and out["_about"] == "x"
    assert tiles.lookup("cuda:sm90", "bf16", "gemm", 512, out) == Tile(64, 128, 64, 4, 4)
    json.dumps(out)


# ---- 2. autotuning candidates --------------------------------------------------------------
@pytest.mark.parametrize("capability", CAPS, ids=[f"sm{a}{b}" for a, b in CAPS])
def test_autotune_candidates_at_most_three_and_fit_shared_memory(capability):
    for dtype in (*HALF, torch.float32):
        elem = torch.empty(0, dtype=dtype).element_size()
        for which in ("gemm", "wgrad"):
            for budget in (None, 64 * 1024, 48 * 1024):
                cands = tuning.autotune_candidates(capability, dtype, which, budget)
                limit = budget if budget is not None else tuning.smem_budget(capability)
                assert 1 <= len(cands) <= tuning.MAX_CANDIDATES
                assert all(t.smem_bytes(which, elem) <= limit for t in cands)
                assert len(set(cands)) == len(cands)


def test_candidates_are_pruned_before_compiling():
    # Hopper's third candidate (128x256x64, 3 stages: 144 KiB in bf16) fits an H100, not 99 KiB
    big = tuning.autotune_candidates((9, 0), torch.bfloat16, "gemm", H100_SMEM)
    small = tuning.autotune_candidates((9, 0), torch.bfloat16, "gemm", 99 * 1024)
    assert Tile(128, 256, 64, 3, 8) in big and Tile(128, 256, 64, 3, 8) not in small
    assert len(small) < len(big)


# ---- 3. never plain fp32 on Triton on CUDA -------------------------------------------------
def test_fp32_on_cuda_runs_on_triton_only_as_tf32():
    assert triton_runs_dtype(torch.float32, "cuda", (9, 0), tf32=True)
    assert not triton_runs_dtype(torch.float32, "cuda", (9, 0), tf32=False)
    assert not triton_runs_dtype(torch.float32, "cuda", (7, 5), tf32=True)  # no TF32 tensor cores
    assert not triton_runs_dtype(torch.float32, "cuda", None, tf32=True)
    for dtype in HALF:
        assert triton_runs_dtype(dtype, "cuda", (9, 0), tf32=False)
    assert not triton_runs_dtype(torch.float64, "cuda", (9, 0), tf32=True)
    assert triton_runs_dtype(torch.float32, "cpu", None, tf32=False)  # the interpreter stays exact


# ---- 4. no recompile for a new expert count ------------------------------------------------
@pytest.mark.parametrize("which", ["gemm", "wgrad"])
def test_expert_count_is_not_part_of_the_specialisation(which):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from lightning_hetermoe.kernels import launch, triton_src

    src = triton_src.grouped_gemm_kernel if which == "gemm" else triton_src.grouped_wgrad_kernel
    fn = launch.jitted(src)
    flags = {p.name: p.do_not_specialize for p in fn.params}
    assert flags["E"] and flags["M_BUCKET"]
    assert not flags["N"] and not flags["K"], "the model's widths stay specialised"
    backend = make_backend(GPUTarget("cuda", 90, 32))
    t = torch.empty(4)

    def specialisations(kernel):
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        out = []
        for E in (1, 2, 16):
            args = {p.name: (t if p.name.endswith("_ptr") else 64) for p in kernel.params if not p.is_constexpr}
            args["E"] = E
            consts = dict(HAS_IDX=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP=8, INPUT_PRECISION="tf32",
                          UPCAST=False)
            if which == "gemm":
                consts |= dict(HAS_BIAS=True, HAS_OUT_IDX=False, HAS_SCALE=False, TILE_MAP=True, X_DESC=False,
                               W_DESC=False)
            else:
                consts |= dict(X_DESC=False, DY_DESC=False)
            _, spec, _ = binder(**args, **consts)
            out.append(tuple(map(str, spec)))
        return out

    ours = specialisations(fn)
    assert ours[0] == ours[1] == ours[2], "E=1, 2, 16 would compile three kernels"
    plain = specialisations(JITFunction(src))  # Triton's default: 1 and multiples of 16 specialise
    assert len(set(plain)) == 3, "the check would be vacuous"


# ---- 5. what set-up warms ------------------------------------------------------------------
SEQ_LEN, SEQS, R, E, TOP_K = 256, 8, 2, 4, 2


def plan_3_ranks() -> Plan:
    """Attention rank 0 (which holds expert 3 of layer 1 by Asym-EA), expert ranks 1 and 2."""
    placement = [[1, 1, 2, 2], [1, 1, 2, 0]]
    counts = [[sum(1 for p in placement[l] if p == m) for l in range(2)] for m in range(3)]
    return Plan(model="t", cluster="t", seq_len=SEQ_LEN, devices=["h100"] * 3,
                roles=["attention", "expert", "expert"], zp_groups=[ZPGroup([0], [1, 2])], num_microbatches=R,
                seqs_per_rank=[SEQS, 0, 0], placement=placement, base_counts=counts, distep_microbatches=1)


LAYERS = [LayerShape(64, 128, "swiglu", False, TOP_K, 2)] * 2


def test_single_and_ep_warm_nothing_unless_autotuning():
    for schedule in ("single", "ep", "ep_balanced", "datacentric"):
        assert warm_up_keys(schedule, None, 0, LAYERS, torch.bfloat16) == []
    keys = warm_up_keys("ep", None, 0, LAYERS + [None], torch.bfloat16, autotune=True)
    assert len(keys) == 1 and keys[0].rows == tuple(tuning.tuning_buckets()) and keys[0].experts == 2


def test_zebra_warms_the_plan_rows_with_the_local_expert_count():
    plan = plan_3_ranks()
    tokens = SEQS // R * SEQ_LEN  # one micro-batch of the one attention rank: 1024
    # expert rank 1: two experts of four in both layers; largest round 1024 x 2, expected 1024 x 2 x 2 / 4
    assert warm_up_keys("zebra", plan, 1, LAYERS, torch.bfloat16) == [
        (64, 128, "swiglu", False, torch.bfloat16, 2, (tokens, 2 * tokens))]
    # rank 2: two experts in layer 0, one in layer 1 (at most one row per token reaches it)
    k2 = warm_up_keys("zebra", plan, 2, LAYERS, torch.float16)
    assert [(k.experts, k.rows) for k in k2] == [(2, (1024, 2048)), (1, (512, 1024))]
    assert all(k.dtype == torch.float16 for k in k2)
    # the attention rank holds one expert of layer 1 only
    assert [(k.experts, k.rows) for k in warm_up_keys("zebra", plan, 0, LAYERS, torch.bfloat16)] == [(1, (512, 1024))]
    # a layer off Triton warms nothing
    assert [(k.experts, k.rows) for k in warm_up_keys("zebra", plan, 2, [LAYERS[0], None], torch.bfloat16)] == \
        [(2, (1024, 2048))]
    # with autotuning on: every bucket up to the largest round
    auto = warm_up_keys("zebra", plan, 1, LAYERS, torch.bfloat16, autotune=True)
    assert [k.rows for k in auto] == [(256, 512, 1024, 2048)]


def test_distep_warms_its_own_placement_and_micro_batches():
    plan = plan_3_ranks()
    base = plan.placement_for("distep")  # no Asym-EA moves beyond the base counts; one micro-batch
    tokens = SEQS * SEQ_LEN
    for rank in range(3):
        keys = warm_up_keys("distep", plan, rank, LAYERS, torch.bfloat16)
        local = [sum(1 for p in row if p == rank) for row in base]
        want = []
        for n in local:
            if n and (n, (-(-tokens * TOP_K * n // E), tokens * min(TOP_K, n))) not in want:
                want.append((n, (-(-tokens * TOP_K * n // E), tokens * min(TOP_K, n))))
        assert [(k.experts, k.rows) for k in keys] == want


# ---- 6. the routing warm-up ----------------------------------------------------------------
def small_model(backend: str):
    from lightning_hetermoe import ModelConfig, MoEConfig, MoELanguageModel, OptimConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                      moe=MoEConfig(num_experts=4, top_k=2, d_ff=12, expert_backend=backend))
    return MoELanguageModel(cfg, OptimConfig())


def fake_trainer(samples):
    from lightning.pytorch.trainer.states import TrainerFn

    loader = torch.utils.data.DataLoader(samples, batch_size=2)
    loop = SimpleNamespace(_data_source=SimpleNamespace(dataloader=lambda: loader))
    return SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), fit_loop=loop, validate_loop=None,
                           test_loop=None, predict_loop=None)


def test_routing_warm_up_runs_on_the_torch_loop_under_the_run_autocast(monkeypatch):
    from lightning_hetermoe.moe import MoELayer
    from lightning_hetermoe.strategy.routing_warmup import warmup_routing

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the triton backend cannot run here
    model = small_model("triton")
    gen = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, 64, (16,), generator=gen), torch.randint(0, 64, (16,), generator=gen))
               for _ in range(4)]
    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append((mod.experts.backend,
                                                                        torch.is_autocast_enabled("cpu"))))
             for m in model.modules() if isinstance(m, MoELayer)]

    class Precision:
        def forward_context(self):
            return torch.autocast("cpu", dtype=torch.bfloat16)

    shares = warmup_routing(model, fake_trainer(samples), 2, 4, Precision())
    for h in hooks:
        h.remove()
    # one batch of the 4 samples (16 tokens: far fewer than the warm-up wants, all there are)
    assert shares is not None and len(shares) == 1
    assert len(shares[0]) == 2 and all(abs(sum(s) - 1) < 1e-9 for s in shares[0])
    assert seen and all(backend == "torch" and autocast for backend, autocast in seen)
    assert all(m.experts.backend == "triton" for m in model.modules() if isinstance(m, MoELayer)), "restored"


def warm_up_in_ranks(rank: int, world: int, failing: int | None):
    import torch.distributed as dist

    from lightning_hetermoe import comm
    from lightning_hetermoe.moe import MoELayer
    from lightning_hetermoe.strategy.routing_warmup import warmup_routing

    dist.init_process_group("gloo", rank=rank, world_size=world)
    comm.configure(torch.device("cpu"))
    model = small_model("torch")
    seen = []
    first = next(m for m in model.modules() if isinstance(m, MoELayer))
    first.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[0]))
    if rank == failing:
        def fail(mod, args):
            raise torch.cuda.OutOfMemoryError("this rank's share does not fit")
        first.register_forward_pre_hook(fail)
    shares = warmup_routing(model, fake_trainer(warm_up_samples()), 4, 6, None, rank, world)
    return {"shares": shares, "forwarded": seen}


def warm_up_samples():
    gen = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 64, (16,), generator=gen), torch.randint(0, 64, (16,), generator=gen))
            for _ in range(24)]


@pytest.mark.slow  # starts processes
def test_the_routing_warm_up_is_dealt_over_the_ranks_and_sums_to_one_rank_forwarding_it_all():
    """Every rank forwards its deal of the chunks (chunk i to rank i mod world) and the
    counts are summed: the shares equal one process forwarding every chunk (the naive
    reference), on every rank; a rank whose forward fails gives even routing on every rank,
    without leaving the others in the sum."""
    from harness import run_ranks
    from lightning_hetermoe.strategy.routing_warmup import warmup_batches, warmup_routing

    alone = warmup_routing(small_model("torch"), fake_trainer(warm_up_samples()), 4, 6)
    batches = warmup_batches(24, 6, 16)
    assert alone is not None and len(alone) == len(batches) == 4  # the dataset binds: 4 batches of 6
    got = run_ranks(3, warm_up_in_ranks, 3, None)
    assert [r["shares"] for r in got] == [alone] * 3
    # 4 batches of 6 cut into chunks of 4 and 2: 8 chunks, 4 2 4 2 4 2 4 2, dealt in turn,
    # each rank's in one forward (a few hundred tokens)
    assert [r["forwarded"] for r in got] == [[4 + 2 + 4], [2 + 4 + 2], [4 + 2]]
    assert [r["shares"] for r in run_ranks(3, warm_up_in_ranks, 3, 1)] == [None] * 3


def per_chunk_by_hand(model, samples, chunk: int, sequences: int) -> list[list[list[float]]]:
    """The naive warm-up: one forward a chunk, each layer's own count (after its capacity)
    added to its chunk's batch."""
    from lightning_hetermoe.moe import MoELayer
    from lightning_hetermoe.strategy.routing_warmup import warmup_batches

    batches = warmup_batches(len(samples), sequences, samples[0][0].shape[0])
    counts = [[torch.zeros(4, dtype=torch.float64) for _ in range(2)] for _ in batches]
    for b, indices in enumerate(batches):
        for start in range(0, len(indices), chunk):
            got = []
            hooks = [m.register_forward_hook(lambda mod, args, out: got.append(out[1].tokens_per_expert))
                     for m in model.modules() if isinstance(m, MoELayer)]
            with torch.no_grad():
                model(torch.stack([samples[i][0] for i in indices[start:start + chunk]]))
            for h in hooks:
                h.remove()
            for l, c in enumerate(got):
                counts[b][l] += c
    return [[(c / c.sum()).tolist() for c in row] for row in counts]


class DropsOneToken(torch.nn.Module):
    """A model whose MoE layers see one token fewer than the batch holds (the tokens of a
    forward are no whole number of rows a sample)."""

    device = torch.device("cpu")  # as a LightningModule says where it is

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        x = self.model.model.embed(tokens).reshape(-1, self.model.model_cfg.d_model)[:-1]
        for block in self.model.model.blocks:
            x = block.moe(x)[0]
        return x


@pytest.mark.parametrize("case", ["dropless", "capacity", "no row a sample", "padding marked"])
def test_the_warm_up_counts_each_batch_as_one_forward_a_chunk_does(case):
    """A rank's small chunks go through the model together where its layers are dropless (the
    router routes each token alone), and each token's choices count for its own sample's
    batch; a layer with a capacity (it drops by the forward's tokens), a model whose layers
    see no whole rows a sample, or layers a strategy marks padding on (the layer's own count
    leaves it out), gets one forward a chunk. Either way the shares are the naive warm-up's,
    batch by batch."""
    from lightning_hetermoe import ModelConfig, MoEConfig, MoELanguageModel, OptimConfig
    from lightning_hetermoe.moe import MoELayer
    from lightning_hetermoe.strategy.routing_warmup import warmup_routing

    torch.manual_seed(0)
    moe = MoEConfig(num_experts=4, top_k=2, d_ff=12, expert_backend="torch",
                    capacity_factor=1.0 if case == "capacity" else 0.0)
    model = MoELanguageModel(ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=16, moe=moe),
                             OptimConfig())
    module = DropsOneToken(model) if case == "no row a sample" else model
    if case == "padding marked":  # every token's place real, but marked: as a padded step's layers are
        for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
            layer.real_tokens = lambda n: torch.ones(n, dtype=torch.bool)
    samples = warm_up_samples()
    forwards = []
    first = next(m for m in model.modules() if isinstance(m, MoELayer))
    first.register_forward_pre_hook(lambda mod, args: forwards.append(args[0].shape[:-1].numel()))
    shares = warmup_routing(module, fake_trainer(samples), 4, 6)
    forwarded, forwards[:] = list(forwards), []
    want = per_chunk_by_hand(module, samples, 4, 6)
    assert shares is not None and len(shares) == 4
    for got, expected in zip(shares, want, strict=True):
        for g, e in zip(got, expected, strict=True):
            assert g == pytest.approx(e, abs=1e-12)
    tokens = 24 * 16
    if case == "dropless":  # all 8 chunks in one forward
        assert forwarded == [tokens]
    elif case == "capacity":  # one forward a chunk: 4 and 2 samples a batch
        assert forwarded == [4 * 16, 2 * 16] * 4
    elif case == "padding marked":  # tried together, then one forward a chunk
        assert forwarded == [tokens] + [4 * 16, 2 * 16] * 4
    else:  # tried together, then one forward a chunk (one token short each)
        assert forwarded[0] == tokens - 1 and forwarded[1:] == [4 * 16 - 1, 2 * 16 - 1] * 4


def selection_run(monkeypatch, world: int, mode: str):
    from lightning.pytorch.plugins.precision import Precision

    from lightning_hetermoe.strategy import selection

    calls = []
    monkeypatch.setattr(selection, "warmup_routing", lambda *a, **k: calls.append(a) or [[[0.25] * 4] * 2])
    monkeypatch.setattr(selection, "loader_batch_shape", lambda trainer: (4, 16))
    monkeypatch.setattr(selection, "run_topology", lambda cluster, device: None)
    built = []
    monkeypatch.setattr(selection, "_build", lambda args, clock, choice, *a, **k:
                        built.append(choice) or SimpleNamespace(simulated=lambda: None))

    class Clock:
        bound, per_rank, expert_load, topology, devices, prediction = True, 4, None, None, None, None

        def bind(self, *args):
            pass

        def predict(self, sim):
            return None

    args = SimpleNamespace(mode=mode, cluster=None, emulated=False, batch_split="equal", allow_emulated_bf16=False,
                           plan=None, expert_load=None, expert_parallel_size=world)
    strategy = SimpleNamespace(args=args, clock=Clock(), lightning_module=small_model("torch"), world_size=world,
                               global_rank=0, root_device=torch.device("cpu"), precision_plugin=Precision(),
                               measure_busy=False, broadcast=lambda obj, src=0: obj)
    selection.select_backend(strategy, trainer=None)
    return calls, built


def test_routing_warm_up_is_skipped_for_the_single_device_shortcut(monkeypatch):
    calls, built = selection_run(monkeypatch, 1, "auto")
    assert built == ["single"] and calls == []
    calls, built = selection_run(monkeypatch, 2, "ep")  # the EP prediction reads the routing
    assert built == ["ep"] and len(calls) == 1


def test_strategy_set_up_warms_what_warm_up_keys_says(monkeypatch):
    """The strategy's set-up hook on a (pretended) H100: zebra warms the plan's rows with the
    rank's local experts in the autocast dtype; ep warms nothing; fp32 without TF32 leaves
    Triton, so nothing is warmed for it."""
    import lightning_hetermoe.moe as moe_package
    from lightning_hetermoe import kernels
    from lightning_hetermoe.strategy.hetermoe import HeterMoEStrategy

    calls = []
    monkeypatch.setattr(kernels, "warm_up", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(moe_package, "resolve_backend", lambda name, device: kernels.grouped_mlp)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    model = small_model("triton")
    cuda = torch.device("cuda", 0)

    def set_up(schedule, precision, rank=1):
        calls.clear()
        fake = SimpleNamespace(root_device=cuda, precision_plugin=SimpleNamespace(precision=precision),
                               lightning_module=model, global_rank=rank,
                               backend=SimpleNamespace(schedule=schedule, plan=plan_3_ranks()))
        HeterMoEStrategy._tune_kernels(fake)
        return [(a[:5], k["rows"], k["experts"]) for a, k in calls]

    ex = next(m.experts for m in model.modules() if hasattr(m, "experts"))
    shape = (ex.d_model, ex.d_ff, ex.activation, ex.b_up is not None)
    assert set_up("zebra", "bf16-mixed") == [((*shape, torch.bfloat16), [1024, 2048], 2)]
    assert set_up("zebra", "16-mixed", rank=0) == [((*shape, torch.float16), [512, 1024], 1)]
    assert set_up("ep", "bf16-mixed") == [] and set_up("single", "bf16-mixed") == []
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "ieee"
        assert set_up("zebra", "32-true") == []
        matmul.fp32_precision = "tf32"
        assert set_up("zebra", "32-true") == [((*shape, torch.float32), [1024, 2048], 2)]
    finally:
        matmul.fp32_precision = before


def test_warm_up_batches_hold_the_token_budget_in_disjoint_global_batches():
    from lightning_hetermoe.strategy.routing_warmup import (WARMUP_BATCHES, WARMUP_TOKENS, pooled_share, split_routing,
                                                        warmup_batches)

    small = warmup_batches(1000, 12, 64)  # 768 tokens a batch: the cap binds
    assert len(small) == WARMUP_BATCHES and all(len(b) == 12 for b in small)
    flat = [i for b in small for i in b]
    assert len(set(flat)) == len(flat) and flat != sorted(flat), "disjoint, and drawn as a shuffle would"
    assert len(warmup_batches(1000, 64, 512)) == -(-WARMUP_TOKENS // (64 * 512))  # the budget binds
    assert len(warmup_batches(10_000, 512, 4096)) == 1  # one batch past the budget is enough
    assert len(warmup_batches(30, 12, 64)) == 2  # the dataset binds: whole batches only
    assert sorted(warmup_batches(5, 12, 64)[0]) == list(range(5))  # fewer samples than a batch: all of them
    a, b, c = [[0.5, 0.5]], [[1.0, 0.0]], [[0.0, 1.0]]
    assert split_routing([a, b, c]) == ([[0.5, 0.5]], [b, c])  # plan on the first half, predict on the rest
    assert split_routing([b]) == ([[1.0, 0.0]], [b])
    assert split_routing(None) == (None, None) and pooled_share([b, c]) == [[0.5, 0.5]]


def test_a_tile_table_is_read_by_the_device_s_kind_not_its_capability(monkeypatch):
    """An MI250X under ROCm reports capability (9, 0), as an H100 does: a launch there takes
    the heuristic fitted to its 64 KiB, not a tile the table holds for cuda:sm90 (timed on
    an H100), even one small enough to fit there."""
    from lightning_hetermoe.kernels import launch, triton_src

    h100s = Tile(64, 64, 32, 2, 4)
    assert h100s.smem_bytes("gemm", 2) <= 64 * 1024
    assert h100s != tuning.default_tile((9, 0), torch.bfloat16, "gemm", 4096, 64 * 1024)
    table = {"cuda:sm90": {"bf16": {"gemm": {"4096": h100s.to_json()}}}}
    monkeypatch.setattr(tiles, "load", lambda: table)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    launch._device.cache_clear(), launch._tile.cache_clear()

    def launched(hip, arch, smem):
        monkeypatch.setattr(torch.version, "hip", hip)
        props = SimpleNamespace(gcnArchName=arch, shared_memory_per_block_optin=smem)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        launch._device.cache_clear()
        try:
            return launch._kernel(triton_src.grouped_gemm_kernel, "gemm", torch.device("cuda", 0), torch.bfloat16,
                                  4096)[1]
        finally:
            launch._device.cache_clear(), launch._tile.cache_clear()

    assert launched(None, "", H100_SMEM) == tuning.with_group(h100s.launch_kwargs())  # the H100 takes the table's
    on_amd = launched("6.2.41133", "gfx90a:sramecc+:xnack-", 64 * 1024)
    assert on_amd == tuning.with_group(tuning.default_tile((9, 0), torch.bfloat16, "gemm", 4096, 64 * 1024)
                                       .launch_kwargs())
    assert Tile(on_amd["BLOCK_M"], on_amd["BLOCK_N"], on_amd["BLOCK_K"], on_amd["num_stages"],
                on_amd["num_warps"]).smem_bytes("gemm", 2) <= 64 * 1024
