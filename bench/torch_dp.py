#!/usr/bin/env python3
r"""strata.torch's data parallelism under torchrun, against one process and against the peers (issue #48).

    PYTHONPATH=<strata.torch for this torch> python bench/torch_dp.py --nproc 1,2,4 --json [--check]
        [--peers fsdp2,deepspeed] [--dim 256 --layers 4 --seq 64 --batch 16 --steps 6 --warmup 2 --rounds 3]

The work: examples/torch_gpt.py's GPT, built with seed 0, trained with AdamW on the same global batches of
--batch sequences (the README's license texts, torch_gpt.batches with seed 1). At W ranks each rank takes its
1/W of every global batch. Every rank is a process started by torchrun (`python -m torch.distributed.run
--standalone --nproc_per_node W`; torch 1.13's torchrun does not start under Python 3.11, so there the ranks
are started here with a file:// rendezvous: --launcher spawn), each on a gloo process group.

Per W, one round runs, in an order that rotates from round to round:
  one      strata.torch in one process taking the global batch as W micro-batches of gradient accumulation
           (loss / W): the same global batch, the work W ranks split. Its params are what the W ranks' must be
           bit for bit (Note [Ranks under torchrun] in python/strata/torch/_processes.py);
  strata   strata.torch over the W ranks;
  fsdp2    FSDP2 (torch.distributed.fsdp.fully_shard on a CPU device mesh, every block and the root) with
           torch.optim.AdamW, over the W ranks (torch 2.x only);
  deepspeed DeepSpeed ZeRO stage 3 on its CPU accelerator over gloo (as bench/zero_infinity.py runs it,
           without offload), its AdamW, gradient_clipping 0 (torch 2.x venv only; skipped with the reason
           where DeepSpeed does not import or initialise).
A run trains --warmup steps, then --steps timed steps, each ended by a barrier, so a step is the slowest
rank's; its figure is the median step. Per W, rank 0's report:
  bit_identical                  the W ranks' losses (times 1/W) and final params equal `one`'s bit for bit
                                 (params compared on every rank)
  state_bytes_per_rank_over_w1   a rank's bytes of masters and optimizer states (Runtime::state_bytes) over
                                 one process's
  comm_bytes_over_theory         bytes a rank sent per timed step (its communicator's counters) over the
                                 theory's 2 (W - 1)/W of the fp32 params (reduce-scatter of the gradients,
                                 all-gather of the params)
  tokens_per_s                   global tokens per median step; tokens_per_s_over_w1: over W = 1's (one
                                 process with every core, the same global batch); tokens_per_s_over_one:
                                 over `one`'s (run with a rank's torch threads, as its bits require), the
                                 median over rounds of each round's ratio
  strata_over_fsdp2, strata_over_deepspeed   strata's median step over the peer's, per round; the median and
                                 the range over rounds (< 1: strata faster)
--check fails (exit 1) unless bit_identical holds at every W, state bytes per rank <= 1/W + 0.02 of W = 1's
and comm bytes <= 1.02 x theory. The machine's cores are shared by the ranks: unless told, each rank's
torch and strata threads are the cores / W.
"""

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ENGINES = ("one", "strata", "fsdp2", "deepspeed")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", default="1,2,4", help="world sizes, comma-separated")
    p.add_argument("--peers", default="fsdp2,deepspeed", help="peers to run beside strata (or none)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences); a multiple of every W")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--launcher", choices=("auto", "torchrun", "spawn"), default="auto")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--json", action="store_true")
    p.add_argument("--check", action="store_true")
    # a rank's own arguments
    p.add_argument("--worker", choices=ENGINES)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--out")
    p.add_argument("--store")
    p.add_argument("--rank", type=int)
    p.add_argument("--torch-threads", type=int, default=0, help="a rank's torch threads; 0 = cores / W")
    return p.parse_args(argv)


# ---- a rank ---------------------------------------------------------------------------------------------

def digest(state):
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def build(args, engine, world, cores):
    """(model to call, backward(loss), step(), info) for one engine on this rank."""
    from torch_gpt import Gpt
    torch.manual_seed(0)
    model = Gpt(d=args.dim, layers=args.layers, heads=max(1, args.dim // 64), seq=args.seq)
    info = {"params": sum(p.numel() for p in model.parameters())}
    if engine in ("one", "strata"):
        import strata.torch as st
        cfg = {"device": {"kind": "sim", "budget": "1GiB"},
               "budgets": {"host": 24 * info["params"] + (256 << 20)}, "threads": cores, "comm": {"timeout_s": 120}}
        if engine == "one":
            cfg["gradient_accumulation_steps"] = args.accum
        model = st.wrap(model, cfg)
        opt = st.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    elif engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, foreach=False)
    else:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        cfg = {"train_micro_batch_size_per_gpu": args.batch // world, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
               "zero_optimization": {"stage": 3}, "gradient_clipping": 0.0,
               "zero_allow_untested_optimizer": True}
        ds, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return ds, ds.backward, ds.step, info

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, lambda loss: loss.backward(), step, info


def rank_main(args):
    import torch.nn.functional as F
    from torch_gpt import batches, corpus
    if args.store:  # --launcher spawn
        rank, world = args.rank, args.world
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        dist.init_process_group("gloo", init_method="file://" + args.store, rank=rank, world_size=world)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo")
    cores = max(1, len(os.sched_getaffinity(0)) // world)
    torch.set_num_threads(args.torch_threads or cores)
    model, backward, step, info = build(args, args.worker, world, cores)
    it = batches(corpus(fixed=True), args.batch, args.seq, seed=1)
    part = args.batch // world
    micro = part // args.accum
    losses, times, comm0 = [], [], None
    for i in range(args.warmup + args.steps):
        x, y = next(it)
        x, y = x[rank * part:(rank + 1) * part], y[rank * part:(rank + 1) * part]
        if i == args.warmup and args.worker == "strata" and model.strata._comm is not None:
            comm0 = model.strata._comm.stats()
        dist.barrier()
        t0 = time.perf_counter()
        for m in range(args.accum):
            xs, ys = x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]
            logits = model(xs)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1))
            if args.accum > 1:
                loss = loss * (1.0 / args.accum)
            backward(loss)
            losses.append(float(loss.detach()))
        step()
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    result = {"rank": rank, "world": world, "engine": args.worker, "losses": [v.hex() for v in losses],
              "step_s": statistics.median(times), "params": info["params"]}
    if args.worker in ("one", "strata"):
        result["state_bytes"] = model.strata.engine.layout()["state_bytes"]
        result["digest"] = digest(model.state_dict())
        if comm0 is not None:
            c1 = model.strata._comm.stats()
            sent = sum(c1[k] - comm0[k] for k in c1 if k.endswith("_bytes"))
            result["comm_bytes_per_step"] = sent / args.steps
        model.strata.close()
    with open(os.path.join(args.out, f"{args.worker}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# ---- the driver ---------------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, engine, world, accum, out, torch_threads=0):
    """Runs one engine on `world` ranks; returns every rank's result, or raises with the output."""
    worker = [os.path.abspath(__file__), "--worker", engine, "--accum", str(accum),
              "--torch-threads", str(torch_threads),
              "--out", out, "--dim", str(args.dim), "--layers", str(args.layers), "--seq", str(args.seq),
              "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--lr", repr(args.lr)]
    env = dict(os.environ, STRATA_LOG_LEVEL=os.environ.get("STRATA_LOG_LEVEL", "error"))
    if args.launcher == "torchrun":
        cmds = [[sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                 "--max-restarts=0", *worker]]
    else:
        store = os.path.join(out, f"store-{engine}-{world}")
        cmds = [[sys.executable, *worker, "--world", str(world), "--rank", str(r), "--store", store]
                for r in range(world)]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for c in cmds]
    outs = []
    try:
        for p in procs:
            o, _ = p.communicate(timeout=args.timeout)
            outs.append((p.returncode, o))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    files = [os.path.join(out, f"{engine}-rank{r}.json") for r in range(world)]
    if any(rc != 0 for rc, _ in outs) or not all(os.path.exists(f) for f in files):
        text = "\n".join(o[-3000:] for _, o in outs)
        raise RuntimeError(f"{engine} at W = {world} failed:\n{text}")
    results = []
    for f in files:
        with open(f) as fh:
            results.append(json.load(fh))
        os.remove(f)
    return results


def peers_available(wanted):
    """{peer: None when it can run, else why not}."""
    why = {}
    major = int(torch.__version__.split(".")[0])
    for peer in wanted:
        if peer == "fsdp2":
            try:
                from torch.distributed.fsdp import fully_shard  # noqa: F401
                why[peer] = None
            except ImportError as e:
                why[peer] = f"this torch ({torch.__version__}) has no FSDP2: {e}"
        elif peer == "deepspeed":
            if major < 2:
                why[peer] = "DeepSpeed is installed in the torch 2.x venv only"
                continue
            try:
                import deepspeed  # noqa: F401
                why[peer] = None
            except Exception as e:  # noqa: BLE001 -- reported
                why[peer] = f"import deepspeed failed: {type(e).__name__}: {e}"
    return why


def bit_identical(ranks, one, world):
    """The W ranks' losses (x 1/W) and params equal one process's with W micro-batches."""
    if any(r["digest"] != one["digest"] for r in ranks):
        return False
    ref = [float.fromhex(v) for v in one["losses"]]
    for r in ranks:
        for s, v in enumerate(r["losses"]):
            got = torch.tensor(float.fromhex(v), dtype=torch.float32) * (1.0 / world)
            if got.item() != ref[s * world + r["rank"]]:
                return False
    return True


def main():
    args = parse_args()
    if args.worker is not None:
        return rank_main(args)
    worlds = [int(w) for w in args.nproc.split(",")]
    if any(args.batch % w for w in worlds):
        raise SystemExit(f"torch_dp: --batch {args.batch} must be a multiple of every --nproc ({args.nproc})")
    if args.launcher == "auto":
        args.launcher = "torchrun" if int(torch.__version__.split(".")[0]) >= 2 else "spawn"
    wanted = [p for p in args.peers.split(",") if p and p != "none"]
    skipped = {p: w for p, w in peers_available(wanted).items() if w is not None}
    peers = [p for p in wanted if p not in skipped]
    report = {"torch": torch.__version__, "launcher": args.launcher, "model": {"dim": args.dim, "layers": args.layers,
              "seq": args.seq, "global_batch": args.batch}, "steps": args.steps, "rounds": args.rounds,
              "peers_skipped": skipped, "convention": "ratios are step times, < 1: strata faster; "
              "tokens_per_s over `one`: the same global batch in one process", "by_world": {}}
    w1_state = None
    w1_tokens = None
    cores = len(os.sched_getaffinity(0))
    ok = True
    with tempfile.TemporaryDirectory(prefix="strata-torch-dp-") as out:
        for world in worlds:
            rounds = []
            for r in range(args.rounds):
                order = ["one", "strata", *peers]
                order = order[r % len(order):] + order[:r % len(order)]
                # `one` runs torch with a rank's threads: torch's CPU reductions split by thread, and the
                # bits must be the ranks' (strata's own are exact whatever its threads).
                got = {e: launch(args, e, 1, world, out, max(1, cores // world)) if e == "one" else
                       launch(args, e, world, 1, out) for e in order}
                rounds.append(got)
            last = rounds[-1]
            one, ranks = last["one"][0], last["strata"]
            if w1_state is None:
                w1_state = one["state_bytes"]  # one process holds every state, whatever W
            step = [g["strata"][0]["step_s"] for g in rounds]
            tokens = args.batch * args.seq
            entry = {
                "bit_identical": all(bit_identical(g["strata"], g["one"][0], world) for g in rounds),
                "state_bytes_per_rank": ranks[0]["state_bytes"],
                "state_bytes_per_rank_over_w1": ranks[0]["state_bytes"] / w1_state,
                "step_s_median": statistics.median(step),
                "tokens_per_s": tokens / statistics.median(step),
                "tokens_per_s_over_one": statistics.median(g["one"][0]["step_s"] / g["strata"][0]["step_s"]
                                                           for g in rounds),
                "one_step_s_median": statistics.median(g["one"][0]["step_s"] for g in rounds),
            }
            if world == 1:
                w1_tokens = entry["tokens_per_s"]
            if w1_tokens is not None:
                entry["tokens_per_s_over_w1"] = entry["tokens_per_s"] / w1_tokens
            if world > 1:
                theory = 2 * (world - 1) / world * ranks[0]["params"] * 4
                entry["comm_bytes_per_step"] = ranks[0]["comm_bytes_per_step"]
                entry["comm_bytes_over_theory"] = ranks[0]["comm_bytes_per_step"] / theory
            for peer in peers:
                ratios = [g["strata"][0]["step_s"] / g[peer][0]["step_s"] for g in rounds]
                entry[f"{peer}_step_s_median"] = statistics.median(g[peer][0]["step_s"] for g in rounds)
                entry[f"strata_over_{peer}"] = statistics.median(ratios)
                entry[f"strata_over_{peer}_range"] = [min(ratios), max(ratios)]
            report["by_world"][str(world)] = entry
            ok &= entry["bit_identical"] and entry["state_bytes_per_rank_over_w1"] <= 1 / world + 0.02
            if world > 1:
                ok &= entry["comm_bytes_over_theory"] <= 1.02
            if not args.json:
                print(f"W = {world}: {json.dumps(entry)}", flush=True)
    report["check_ok"] = ok
    if args.json:
        print(json.dumps(report, indent=1))
    if args.check and not ok:
        print("torch_dp: --check failed (see by_world)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
