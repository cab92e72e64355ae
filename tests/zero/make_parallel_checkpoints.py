#!/usr/bin/env python
"""Save real DeepSpeed checkpoints with model, pipeline and expert parallelism, on CPU.

    python make_parallel_checkpoints.py OUT [--cases mp-s1,...] [--port N]

Four ranks are forked from this process (deepspeed imported once in the parent; gloo over
127.0.0.1; DeepSpeed's CPU accelerator). Every case runs in the same four processes and is
saved by DeepSpeed itself with engine.save_checkpoint(OUT/<case>) after two training steps:

  mp-s1, mp-s2, mp-s3  ZeRO stage 1/2/3, bf16, deepspeed.initialize(mpu=MinimalMpu): 2
                       model-parallel x 2 data-parallel ranks (Megatron layout: mp groups
                       {0,1} {2,3}, dp groups {0,2} {1,3}). Each mp rank holds its own slice of
                       a column- and a row-parallel Linear (and its own buffer values), so
                       mp_rank_00 and mp_rank_01 differ. Also a frozen Linear, a float and an
                       int buffer, a non-persistent buffer, a replicated LayerNorm.
  pipe                 deepspeed.pipe.PipelineModule, 2 stages x 2 dp (axes pipe, data), ZeRO-1,
                       bf16: layer_XX-model_states.pt; tied layers 0 and 4 (first and last
                       stage), a function layer 1 (no file), a layer with a buffer and a
                       frozen parameter.
  pipe-tp2             PipelineModule on PipeModelDataParallelTopology(pp 2, mp 2, dp 1), ZeRO-1,
                       fp32: layer_XX-model_YY-model_states.pt, values differ per model rank.
  pipe-tp1             the same topology with mp 1, dp 2: layer_XX-model_00-model_states.pt
                       only (what Megatron-DeepSpeed writes with tensor parallelism 1).
  moe-s2, moe-s0       deepspeed.moe.layer.MoE (2 experts, ep_size 1), ZeRO-2 / ZeRO off:
                       layer_0_expert_{0,1}_mp_rank_00_model_states.pt (moe-s0 also
                       expp_rank_0_mp_rank_00_optim_states.pt, which 0.19.8 skips under ZeRO).

OUT/<case>/ is the save dir (latest, <tag>/, zero_to_fp32.py), and OUT/<case>/case.json
says how it was made. Takes ~10 s on two cores.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

WORLD = 4
ALL_CASES = ("mp-s1", "mp-s2", "mp-s3", "pipe", "pipe-tp2", "pipe-tp1", "moe-s2", "moe-s0")
STEPS = 2


def preimport():
    """Heavy imports once in the parent, before the ranks are forked."""
    import torch  # noqa: F401
    import deepspeed  # noqa: F401
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.bf16_optimizer  # noqa: F401
    import deepspeed.runtime.pipe.engine  # noqa: F401
    import deepspeed.moe.layer  # noqa: F401
    try:
        import deepspeed.runtime.zero.muon.original_muon  # noqa: F401
    except Exception:
        pass


def base_config(stage, dtype):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        cfg["zero_optimization"]["sub_group_size"] = 1000000000
    return cfg


class MinimalMpu:
    """The model-parallel unit deepspeed.initialize(mpu=...) asks for: ranks, sizes and groups
    of the model-parallel and data-parallel dimensions. Rank r is mp rank r % MP, dp rank
    r // MP (consecutive ranks share a model replica, as in Megatron)."""

    def __init__(self, dist, mp_size):
        world, rank = dist.get_world_size(), dist.get_rank()
        self.mp_size, self.dp_size = mp_size, world // mp_size
        self.mp_rank, self.dp_rank = rank % mp_size, rank // mp_size
        # Every rank creates every group, in the same order.
        for d in range(self.dp_size):
            ranks = list(range(d * mp_size, (d + 1) * mp_size))
            g = dist.new_group(ranks)
            if rank in ranks:
                self.mp_group, self.mp_ranks = g, ranks
        for m in range(mp_size):
            ranks = list(range(m, world, mp_size))
            g = dist.new_group(ranks)
            if rank in ranks:
                self.dp_group, self.dp_ranks = g, ranks

    def get_model_parallel_rank(self):
        return self.mp_rank

    def get_model_parallel_world_size(self):
        return self.mp_size

    def get_model_parallel_group(self):
        return self.mp_group

    def get_model_parallel_src_rank(self):
        return self.mp_ranks[0]

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp_size

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_group_ranks(self):
        return self.dp_ranks


def mp_model(torch, nn, mp_rank, mp_size):
    """A two-layer MLP split Megatron style: fc1 by output rows, fc2 by input columns, cut
    from the same full Linear on every rank (so the two mp ranks hold different slices)."""
    d, h = 6, 14  # h/mp = 7 elements per row slice: partitions do not divide evenly

    class MpNet(nn.Module):

        def __init__(self):
            super().__init__()
            torch.manual_seed(4321)  # the same full weights everywhere
            full1, full2 = nn.Linear(d, h), nn.Linear(h, d)
            per = h // mp_size
            rows = slice(mp_rank * per, (mp_rank + 1) * per)
            self.fc1 = nn.Linear(d, per)
            self.fc2 = nn.Linear(per, d, bias=False)
            with torch.no_grad():
                self.fc1.weight.copy_(full1.weight[rows])
                self.fc1.bias.copy_(full1.bias[rows])
                self.fc2.weight.copy_(full2.weight[:, rows])
            self.ln = nn.LayerNorm(d)  # replicated across mp ranks
            self.frozen = nn.Linear(d, 3)
            for p in self.frozen.parameters():
                p.requires_grad_(False)
            self.register_buffer("pos_scale", torch.linspace(0.5, 1.5, d) + mp_rank)
            self.register_buffer("steps_seen", torch.tensor(1000 + mp_rank, dtype=torch.int64))
            self.register_buffer("scratch", torch.ones(2), persistent=False)

        def forward(self, x):
            x = x * self.pos_scale.to(x.dtype)
            # Tensor parallelism would all-reduce fc2's output over the mp group; the files
            # are what matters here, so each mp rank trains its own partial sum.
            y = self.ln(x + self.fc2(torch.relu(self.fc1(x))))
            return y.sum(-1) + self.frozen(y).sum(-1)

    return MpNet()


def run_mp_zero(stage, save_dir, torch, nn, deepspeed, dist):
    mpu = MinimalMpu(dist, mp_size=2)
    model = mp_model(torch, nn, mpu.mp_rank, mpu.mp_size)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=base_config(stage, "bf16"), mpu=mpu)
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    for _ in range(STEPS):
        x = torch.randn(2, 6, generator=g).to(torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(save_dir)
    return {"parallelism": "2 mp x 2 dp via deepspeed.initialize(mpu=MinimalMpu)", "zero_stage": stage,
            "dtype": "bf16", "optimizer": type(engine.optimizer).__name__}


def run_pipe(save_dir, torch, nn, deepspeed, dist, tp):
    """tp=None: axes pipe, data (2 stages x 2 dp); tp=N: axes pipe, data, model (2 stages x N
    model ranks x 4/(2N) dp), so layer files carry -model_YY."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    d = 5
    rank = dist.get_rank()

    class Dense(nn.Module):
        """Linear whose values depend on a seed (differs per model rank with tp)."""

        def __init__(self, n_in, n_out, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.lin = nn.Linear(n_in, n_out)

        def forward(self, x):
            return self.lin(x)

    class NormWithState(nn.Module):
        """A layer with a persistent buffer, a non-persistent buffer and a frozen parameter."""

        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.norm = nn.LayerNorm(d)
            self.gate = nn.Parameter(torch.randn(d), requires_grad=False)
            self.register_buffer("shift", torch.arange(d, dtype=torch.float32) / 10 + seed)
            self.register_buffer("scratch", torch.ones(3), persistent=False)

        def forward(self, x):
            return self.norm(x + self.shift.to(x.dtype)) * self.gate.to(x.dtype)

    def loss_fn(out, y):
        return (out.float() - y).pow(2).mean()

    if tp is None:
        layers = [
            TiedLayerSpec("embed", Dense, d, d, 1, tied_weight_attr="lin.weight"),
            torch.relu,  # a plain function: a layer index without a file
            LayerSpec(Dense, d, d, 2),
            LayerSpec(NormWithState, 3),
            TiedLayerSpec("embed", Dense, d, d, 1, tied_weight_attr="lin.weight"),  # tied to layer 0
        ]
        module = PipelineModule(layers=layers, num_stages=2, loss_fn=loss_fn, partition_method="uniform")
        cfg, out_dim = base_config(1, "bf16"), d
        desc = "PipelineModule(num_stages=2): 2 stages x 2 dp (axes pipe, data), tied layers 0 and 4"
    else:
        topo = PipeModelDataParallelTopology(num_pp=2, num_mp=tp, num_dp=WORLD // (2 * tp))
        m = topo.get_coord(rank).model
        layers = [
            LayerSpec(Dense, d, 7, 10 + m),
            torch.tanh,  # a plain function: a layer index without a file
            LayerSpec(Dense, 7, d, 20 + m),
            LayerSpec(NormWithState, 30 + m),
            LayerSpec(Dense, d, 2, 40 + m),
        ]
        module = PipelineModule(layers=layers, topology=topo, loss_fn=loss_fn, partition_method="uniform")
        cfg, out_dim = base_config(1, "fp32"), 2
        desc = f"PipelineModule, PipeModelDataParallelTopology(num_pp=2, num_mp={tp}, num_dp={WORLD // (2 * tp)})"
    cfg["gradient_accumulation_steps"] = 2  # micro-batches per train_batch
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=cfg)
    dtype = torch.bfloat16 if cfg.get("bf16") else torch.float32
    g = torch.Generator().manual_seed(11)

    def batches():
        while True:
            yield torch.randn(2, d, generator=g).to(dtype), torch.randn(2, out_dim, generator=g)

    it = batches()
    for _ in range(STEPS):
        engine.train_batch(data_iter=it)
    engine.save_checkpoint(save_dir)
    return {"parallelism": desc, "zero_stage": 1, "dtype": str(dtype).removeprefix("torch."),
            "optimizer": type(engine.optimizer).__name__, "num_layers": len(layers)}


def run_moe(save_dir, torch, nn, deepspeed, dist, stage):
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    d = 4
    torch.manual_seed(5)

    class MoeNet(nn.Module):

        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(d, d)
            self.moe = MoE(hidden_size=d, expert=nn.Linear(d, d), num_experts=2, ep_size=1, k=1, min_capacity=4)
            self.out = nn.Linear(d, 1)

        def forward(self, x):
            h, _, _ = self.moe(self.inp(x))
            return self.out(h)

    model = MoeNet()
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": [p for p in model.parameters()], "name": "all"}])
    opt = torch.optim.AdamW(groups, lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=base_config(stage, "fp32"))
    g = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        loss = engine(torch.randn(2, 3, d, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(save_dir)
    return {"parallelism": f"MoE(num_experts=2, ep_size=1), {WORLD} dp ranks", "zero_stage": stage,
            "dtype": "float32", "optimizer": type(engine.optimizer).__name__}


def worker(local_rank, out, cases, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                      WORLD_SIZE=str(WORLD), LOCAL_SIZE=str(WORLD))
    import torch
    import torch.nn as nn
    import deepspeed
    import deepspeed.comm as dist
    import deepspeed.comm.torch  # noqa: F401
    # Otherwise DeepSpeed JIT-compiles its shared-memory allreduce op (C++, minutes).
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    import logging
    from deepspeed.utils import logger
    logger.setLevel(logging.WARNING)
    from deepspeed.utils import groups
    for case in cases:
        t0 = time.time()
        groups.mpu = None  # an engine leaves its mpu (or pipeline grid) in this global
        save_dir = os.path.join(out, case)
        if case.startswith("mp-s"):
            info = run_mp_zero(int(case[4:]), save_dir, torch, nn, deepspeed, dist)
        elif case == "pipe":
            info = run_pipe(save_dir, torch, nn, deepspeed, dist, tp=None)
        elif case.startswith("pipe-tp"):
            info = run_pipe(save_dir, torch, nn, deepspeed, dist, tp=int(case[7:]))
        elif case.startswith("moe-s"):
            info = run_moe(save_dir, torch, nn, deepspeed, dist, stage=int(case[5:]))
        else:
            raise ValueError(f"unknown case {case!r}")
        dist.barrier()
        if dist.get_rank() == 0:
            info.update(case=case, world=WORLD, deepspeed=deepspeed.__version__, torch=torch.__version__,
                        seconds=round(time.time() - t0, 2))
            with open(os.path.join(save_dir, "case.json"), "w") as f:
                json.dump(info, f, indent=1)
            print(f"[make_parallel_checkpoints] {case}: {time.time() - t0:.2f}s", flush=True)
    dist.barrier()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--cases", default=",".join(ALL_CASES))
    ap.add_argument("--port", type=int, default=0, help="rendezvous port (0: pick a free one)")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    port = args.port
    if port == 0:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    t0 = time.time()
    preimport()
    import torch.multiprocessing as mp
    os.makedirs(args.out, exist_ok=True)
    mp.start_processes(worker, args=(os.path.abspath(args.out), cases, port), nprocs=WORLD, start_method="fork",
                       join=True)
    print(f"[make_parallel_checkpoints] total {time.time() - t0:.2f}s", flush=True)


if __name__ == "__main__":
    main()
