"""PyTorch's ways to train the lessons' GPT, one thread per rank, over gloo.

    mpirun -n 2 python3 pytorch/train.py ddp      --data out/ref --json out/ddp.json
    mpirun -n 2 python3 pytorch/train.py fsdp2    --data out/ref --json out/fsdp2.json
    mpirun -n 2 python3 pytorch/train.py fsdp2-ac --data out/ref --json out/fsdp2-ac.json
    mpirun -n 2 python3 pytorch/train.py toy      --data out/ref --json out/toy.json
    python3 pytorch/train.py eval --weights w.safetensors --corpus out/ref/corpus.u32

Launched by mpirun like the lessons (the rank and world size come from
Open MPI's environment); started from `fsdp-reference-data`'s initial
weights, on its batches: rank r takes micro-batches r·M/N … (r+1)·M/N − 1
of each step, and the gradient is the mean over all M, as in the lessons.

- ddp:   `DistributedDataParallel`, gradients all-reduced (no_sync between
         a rank's micro-batches);
- fsdp2: `fully_shard` on every block, then on the root (FSDP2's usual
         wrapping; the root is not resharded after forward);
- fsdp2-ac: the same with activation checkpointing on every block
         (`checkpoint_wrapper` inside `fully_shard`, as torchtitan wraps):
         each block keeps only its input and computes its forward again in
         the backward, as lesson 03 and ZeRO-3 do;
- fsdp2-bf16, fsdp2-bf16-ac: fsdp2 and fsdp2-ac in mixed precision, as
         FSDP2 trains in practice: `MixedPrecisionPolicy(param_dtype=bf16,
         reduce_dtype=fp32)` on every `fully_shard` — the parameters gathered
         and computed in bf16, the gradients reduced (and accumulated between
         micro-batches) in fp32, the sharded fp32 parameters updated;
- zero1-bf16: ZeRO-1 as PyTorch runs it: DDP with `ZeroRedundancyOptimizer`
         (each rank keeps 1/N of AdamW's state and updates its parameters,
         then broadcasts them), the forward and backward under
         `torch.autocast("cpu", torch.bfloat16)` (matmuls in bf16 from the
         fp32 weights, gradients fp32 and all-reduced in fp32);
- toy:   the classic whole-model shard (lesson 02's scheme, the seed toy's):
         each rank keeps 1/N of a flat fp32 vector and its AdamW state,
         all-gathers the whole model every step, reduces the gradient and
         updates its shard. gloo has no reduce-scatter, so the toy
         all-reduces and keeps its slice.
"""
import argparse
import functools
import json
import os
import resource
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext

os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gpt  # noqa: E402

torch.set_num_threads(1)
torch.set_num_interop_threads(1)


def main():
    modes = {
        "ddp": ddp,
        "fsdp2": fsdp2,
        "fsdp2-ac": functools.partial(fsdp2, recompute=True),
        "fsdp2-bf16": functools.partial(fsdp2, bf16=True),
        "fsdp2-bf16-ac": functools.partial(fsdp2, recompute=True, bf16=True),
        "zero1-bf16": zero1_bf16,
        "toy": toy,
    }
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=[*modes, "eval"])
    p.add_argument("--data", help="a folder fsdp-reference-data wrote")
    p.add_argument("--json", help="rank 0 writes the run's losses, step times and peak RSS here")
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--master", default="127.0.0.1", help="rank 0's address (another machine's, or a simulated node's)")
    p.add_argument("--weights", help="eval: a weights file")
    p.add_argument("--corpus", help="eval: token ids (corpus.u32)")
    p.add_argument("--batches", type=int, default=8, help="eval: batches of 8 windows, as fsdp-eval")
    a = p.parse_args()
    if a.mode == "eval":
        return evaluate(a)

    if "OMPI_COMM_WORLD_SIZE" not in os.environ:
        sys.exit("error: launch it with Open MPI's mpirun (mpirun -n N python3 pytorch/train.py …): it takes its rank from there")
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}", rank=rank, world_size=world)
    with open(f"{a.data}/meta.json") as f:
        meta = json.load(f)
    data = gpt.batches(a.data, meta)
    m = meta["micro_batches"]
    assert m % world == 0, f"{m} micro-batches do not divide among {world} ranks"
    mine = range(rank * m // world, (rank + 1) * m // world)
    model = gpt.load(f"{a.data}/init.safetensors")
    adamw = dict(lr=meta["lr"], betas=(meta["beta1"], meta["beta2"]), eps=meta["eps"])
    wd = meta["weight_decay"]
    decayed = [0]  # how many elements AdamW decays, over all ranks: set by the mode
    step_fn = modes[a.mode](model, adamw, wd, world, rank, decayed)

    losses, seconds, norm = [], [], None
    for s in range(meta["steps"]):
        t0 = time.perf_counter()
        loss_sum, n = step_fn([data[s, k] for k in mine], m // world, s == 0)
        seconds.append(time.perf_counter() - t0)  # (step 1's norm is inside; the warm-up skips it)
        norm = norm if n is None else n
        total = torch.tensor([loss_sum], dtype=torch.float64)
        dist.all_reduce(total)  # outside the clock, like the lessons' log line
        losses.append(total.item() / m)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.int64)
    all_rss = [torch.zeros_like(rss) for _ in range(world)]
    dist.all_gather(all_rss, rss)
    if rank == 0 and a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "mode": a.mode,
                    "world_size": world,
                    "torch": torch.__version__,
                    "losses": losses,
                    "step_seconds": seconds,
                    "median_step_seconds": statistics.median(seconds),
                    "peak_rss_bytes": [int(r.item()) for r in all_rss],
                    "step1_grad_norm": norm,
                    "decayed_elements": decayed[0],
                },
                f,
            )
    dist.destroy_process_group()
    # DDP's and FSDP2's gloo worker threads abort the interpreter's normal
    # exit ("terminate called without an active exception"): leave at once.
    sys.stdout.flush()
    os._exit(0)


def micro_batch_losses(model, micro, per_rank, sync=lambda last: nullcontext()):
    """Forward and backward over my micro-batches, each loss scaled by 1/(M/N):
    with the ranks' average, the gradient is the mean over all M. `sync(last)`
    is the context each backward runs in (gradient sync on the last only)."""
    total = 0.0
    for i, b in enumerate(micro):
        with sync(i == len(micro) - 1):
            loss = model(b[0], b[1])
            (loss / per_rank).backward()
        total += loss.item()
    return total


def groups(params, wd):
    """nanoGPT's rule, as the lessons: weight decay on tensors of 2+ dimensions only."""
    params = list(params)
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def ddp(model, adamw, wd, world, rank, decayed):
    from torch.nn.parallel import DistributedDataParallel

    net = DistributedDataParallel(model)  # averages gradients over the ranks
    opt = torch.optim.AdamW(groups(net.parameters(), wd), **adamw)
    decayed[0] = sum(p.numel() for p in opt.param_groups[0]["params"])

    def step(micro, per_rank, want_norm):
        opt.zero_grad(set_to_none=True)
        total = micro_batch_losses(net, micro, per_rank, lambda last: nullcontext() if last else net.no_sync())
        norm = global_norm([q.grad for q in net.parameters()], reduce=False) if want_norm else None
        opt.step()
        return total, norm

    return step


def fsdp2(model, adamw, wd, world, rank, decayed, recompute=False, bf16=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    # bf16: FSDP2's mixed precision, reduce_dtype given (torch 2.15 would take fp32 from the fp32 parameters
    # if left None; before 2.15, None meant param_dtype, bf16).
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    blocks = model.transformer.h
    # With recompute, each block keeps only its input: its backward runs its forward again (after
    # FSDP2's pre-backward hook has gathered the block's weights again), then the backward proper.
    if recompute:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)  # no dropout: no RNG to replay
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # the root: embeddings, ln_f, the tied head
    opt = torch.optim.AdamW(groups(model.parameters(), wd), **adamw)  # DTensors keep their dims
    decayed[0] = sum(p.numel() for p in opt.param_groups[0]["params"])  # a DTensor's numel is the whole tensor's

    @contextmanager
    def sync(last):
        model.set_requires_gradient_sync(last)  # reduce-scatter after the last micro-batch only
        yield

    def step(micro, per_rank, want_norm):
        opt.zero_grad(set_to_none=True)
        total = micro_batch_losses(model, micro, per_rank, sync)
        norm = global_norm([q.grad.to_local() for q in model.parameters()], reduce=True) if want_norm else None
        opt.step()
        return total, norm

    return step


def zero1_bf16(model, adamw, wd, world, rank, decayed):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    net = DistributedDataParallel(model)
    # nanoGPT's decay rule as two parameter groups: ZeroRedundancyOptimizer takes the first as its
    # params and the second through add_param_group.
    decay, rest = groups(net.parameters(), wd)
    opt = ZeroRedundancyOptimizer(decay["params"], optimizer_class=torch.optim.AdamW, weight_decay=wd, **adamw)
    opt.add_param_group(rest)
    decayed[0] = sum(p.numel() for p in decay["params"])

    @contextmanager
    def sync(last):
        with (nullcontext() if last else net.no_sync()), torch.autocast("cpu", dtype=torch.bfloat16):
            yield

    def step(micro, per_rank, want_norm):
        opt.zero_grad(set_to_none=True)
        total = micro_batch_losses(net, micro, per_rank, sync)
        norm = global_norm([q.grad for q in net.parameters()], reduce=False) if want_norm else None
        opt.step()
        return total, norm

    return step


def toy(model, adamw, wd, world, rank, decayed):
    params = list(model.parameters())  # the tied weight once
    numel = sum(q.numel() for q in params)
    shard_len = -(-numel // world)  # padded to a multiple of N
    padded = shard_len * world
    flat = torch.zeros(padded)
    flat[:numel] = torch.cat([q.detach().reshape(-1) for q in params])
    shard = torch.nn.Parameter(flat[rank * shard_len : (rank + 1) * shard_len].clone())  # my fp32 master
    # nanoGPT's decay rule, per element of my shard (it cuts through tensors):
    # decoupled decay by hand, then AdamW without it — torch's own order.
    decays = torch.zeros(padded, dtype=torch.bool)
    at = 0
    for q in params:
        decays[at : at + q.numel()] = q.dim() >= 2
        at += q.numel()
    decays = decays[rank * shard_len : (rank + 1) * shard_len]
    count = torch.tensor([int(decays.sum())], dtype=torch.int64)
    dist.all_reduce(count)
    decayed[0] = int(count.item())
    opt = torch.optim.AdamW([shard], weight_decay=0.0, **adamw)
    gathered = [torch.empty(shard_len) for _ in range(world)]

    def step(micro, per_rank, want_norm):
        # 1. all-gather the whole model into the module's parameters
        dist.all_gather(gathered, shard.detach())
        full = torch.cat(gathered)
        at = 0
        with torch.no_grad():
            for q in params:
                q.copy_(full[at : at + q.numel()].view_as(q))
                q.grad = None
                at += q.numel()
        # 2. forward/backward on my micro-batches
        total = micro_batch_losses(model, micro, per_rank)
        # 3. reduce the gradient (all-reduce: gloo has no reduce-scatter), keep my slice
        g = torch.zeros(padded)
        g[:numel] = torch.cat([q.grad.reshape(-1) for q in params])
        dist.all_reduce(g)
        shard.grad = g[rank * shard_len : (rank + 1) * shard_len] / world
        norm = global_norm([shard.grad], reduce=True) if want_norm else None
        # 4. AdamW on my shard only
        with torch.no_grad():
            shard[decays] *= 1 - adamw["lr"] * wd
        opt.step()
        return total, norm

    return step


def global_norm(grads, reduce):
    """‖g‖ of the whole mean gradient, in f64: from every rank's pieces
    (summed over the ranks) or from a full copy (reduce=False)."""
    sq = torch.tensor([sum(float(g.double().pow(2).sum()) for g in grads)], dtype=torch.float64)
    if reduce:
        dist.all_reduce(sq)
    return float(sq.sqrt())


def evaluate(a):
    """fsdp-eval's loss, computed by PyTorch: consecutive windows of the
    block size, in batches of 8, the mean over windows."""
    model = gpt.load(a.weights)
    t = model.cfg["block_size"]
    tokens = torch.from_numpy(np.fromfile(a.corpus, dtype="<u4").astype(np.int64))
    windows = (tokens.numel() - 1) // t
    n = min(a.batches * 8, windows)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, n, 8):
            idx = list(range(start, min(start + 8, n)))
            x = torch.stack([tokens[i * t : i * t + t] for i in idx])
            y = torch.stack([tokens[i * t + 1 : i * t + t + 1] for i in idx])
            total += model(x, y).item() * len(idx)
            count += len(idx)
    print(json.dumps({"mean_loss": total / count, "windows": count}))


if __name__ == "__main__":
    main()
