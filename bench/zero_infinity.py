#!/usr/bin/env python3
r"""strata against DeepSpeed ZeRO-Infinity: the same GPT, params and optimizer states on NVMe, side by side.

    PYTHONPATH=<strata.torch for this torch> ~/.cache/strata/venv-torch2/bin/python \
        bench/zero_infinity.py --json --check [--peer offload] [--d 1024 --layers 8]

The work (issue #27, "Beat them on the same work, measured side by side"): examples/torch_gpt.py's GPT,
built eagerly with the same seed (so the same initial weights), trained on the same batches with fp32 AdamW
and the same hyperparameters, by
  deepspeed   deepspeed.initialize with ZeRO stage 3, offload_param {device: nvme} and offload_optimizer
              {device: nvme} (ZeRO-Infinity), DeepSpeedCPUAdam, gradient_clipping 0 (DeepSpeed's default
              clips at 1.0; torch and strata do not); DeepSpeed's defaults otherwise (its aio settings,
              buffer counts and sizes), DS_ACCELERATOR=cpu, one process (gloo);
  strata      strata.torch.wrap on the sim device, budgets.host a --host-fraction of the model's 16 B a
              parameter of state (the planner puts the rest on NVMe), budgets.nvme a cap, strata.torch.AdamW.
Each engine runs in a subprocess of its own (one engine's memory and threads never meet the other's). A
round runs DeepSpeed, strata and torch alone (below) once each, the order rotating from round to round
(--rounds), so that the machine's drift hits all alike. A run
trains --warmup steps, then --steps timed steps; its figure is the median step (forward, backward and the
optimizer step, wall time).

  strata_over_deepspeed = strata's median step / DeepSpeed's, per round; the median (and the range) over
                          rounds. < 1: strata faster.

--peer offload compares ZeRO-Offload instead: ZeRO stage 2 with offload_optimizer {device: cpu} (params and
gradients on DeepSpeed's device, the optimizer states in host memory) against strata with the params and
gradients on its device (budgets.gpu 8 B a parameter and three streaming slots) and the states on its host
tier (budgets.host 24 B a parameter and 64 MiB: the states' 8 B, the params' host copies and the planner's
room for gradients), no NVMe.

Beside it, per engine: disk bytes read and written per timed step (/proc/self/io's read_bytes and
write_bytes, which count what reached the block device, not page-cache hits), the peak resident memory
(VmHWM), where strata planned its bytes, and the losses. The third run of a round, torch alone with
torch.optim.AdamW and everything in memory, is the reference: its step time (`over_torch`, the median of the
per-round ratios: what each engine's offload costs) and its losses. Each engine's losses are compared with
torch's (`loss_max_rel_diff_vs_torch`): an engine that does the same work differs by its optimizer's
rounding only. --check fails when strata's differ by more than --loss-rtol; DeepSpeed's difference is
reported, not checked.

Disk: the runs need about 2 x 16 B a parameter under --nvme-dir (checked before anything starts) and remove
their files when they end. DeepSpeed's swap files are named files (strata's are unlinked at creation), so a
run killed with SIGKILL leaves its directory, strata-zi-<pid>-*; the next run removes those whose process is
gone. Exit 77 (with why) when DeepSpeed or its async_io op (libaio-dev) is not available here.
--build-ops builds DeepSpeed's JIT ops that the ZeRO-Infinity run loads (scripts/install-deps runs it).
"""

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when a run fails, a field is missing or the losses disagree")
    ap.add_argument("--peer", choices=("infinity", "offload"), default="infinity",
                    help="infinity: ZeRO-3 with params and optimizer states on NVMe; offload: ZeRO-2 with the "
                         "optimizer states in host memory (ZeRO-Offload), strata with states on its host tier")
    ap.add_argument("--d", type=int, default=512, help="model width (GPT of examples/torch_gpt.py)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds: each runs DeepSpeed, strata and torch alone once, the order rotating")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--host-fraction", type=float, default=0.25,
                    help="strata's budgets.host as a fraction of the model's state bytes (16 B a parameter)")
    ap.add_argument("--loss-rtol", type=float, default=1e-3, help="largest relative loss difference allowed")
    ap.add_argument("--nvme-dir", default=None, help="where the swap files go (default: the temp dir)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds one run may take")
    ap.add_argument("--build-ops", action="store_true", help="build DeepSpeed's ops for this run and exit")
    ap.add_argument("--worker", choices=("deepspeed", "strata", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--swap-dir", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


ARGS = parse_args(sys.argv[1:])
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)  # before torch loads (bench/peers.py's "Threads")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # Note [OpenMP waits in the bench] (bench/torch_gpt.py)

import torch  # noqa: E402

from deepspeed_env import pin_cxx, set_torch_extensions_dir  # noqa: E402

set_torch_extensions_dir(torch.__version__)  # where bench/peers.py and install-deps build DeepSpeed's ops
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

SKIP = 77
CONVENTION = ("strata_over_deepspeed = strata's median step / DeepSpeed's (ZeRO-Infinity, or ZeRO-Offload with "
              "--peer offload), per round of runs; "
              "median over rounds; < 1: strata faster")
DS_OPS = ("AsyncIOBuilder", "ShareMemCommBuilder", "PinMemoryBuilder", "CPUAdamBuilder")


def deepspeed_ops():
    """(ok, info): DeepSpeed's JIT ops that a ZeRO-Infinity run on this machine loads, built or loaded."""
    info = {"torch_extensions_dir": os.environ["TORCH_EXTENSIONS_DIR"]}
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except Exception as e:  # noqa: BLE001 -- reported
        return False, dict(info, why=f"import deepspeed failed: {type(e).__name__}: {e}",
                           fix="scripts/install-deps (the pinned deepspeed, scripts/requirements-torch2.txt)")
    info["deepspeed_version"] = deepspeed.__version__
    pin_cxx()  # one compiler path, so ninja does not rebuild the ops
    for name in DS_OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is None:
            continue
        if not builder.is_compatible(verbose=False):
            return False, dict(info, why=f"DeepSpeed's {name} cannot build here",
                               fix="apt-get install libaio-dev (scripts/install-deps), for async_io")
        t0 = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as e:  # noqa: BLE001 -- reported
            return False, dict(info, why=f"{name}: {type(e).__name__}: {e}",
                               fix=f"see the compiler output; remove {info['torch_extensions_dir']}/{builder.name} "
                                   "to rebuild it")
        info[f"{builder.name}_load_s"] = round(time.perf_counter() - t0, 2)
    return True, info


# ---- the workers (one engine each, in a subprocess) -----------------------------------------

def proc_io():
    """(read_bytes, write_bytes) this process has moved to and from the block device."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def peak_rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def build_model(args):
    from torch_gpt import Gpt
    torch.manual_seed(0)
    return Gpt(d=args.d, layers=args.layers, heads=max(1, args.d // 64), seq=args.seq)


def deepspeed_engine(args, model):
    import socket
    import deepspeed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    zero = ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": args.swap_dir},
             "offload_optimizer": {"device": "nvme", "nvme_path": args.swap_dir}} if args.peer == "infinity" else
            {"stage": 2, "offload_optimizer": {"device": "cpu"}})
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
           "zero_optimization": zero,
           # DeepSpeed clips the gradient norm at 1.0 unless told otherwise (GRADIENT_CLIPPING_DEFAULT in
           # deepspeed/runtime/constants.py, 0.19.8); torch and strata do not clip unless asked. With its
           # default, DeepSpeed's losses leave torch's from the second update on (docs/peers.md).
           "gradient_clipping": 0.0,
           "zero_allow_untested_optimizer": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                           dist_init_required=True)
    return engine, cfg, {"optimizer": type(engine.optimizer).__name__}


def strata_engine(args, model):
    import strata.torch as st
    n = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    gpu = 6 * largest * 4  # 3 slots of chunks up to twice the largest tensor (bench/torch_scale.py)
    if args.peer == "infinity":
        cfg = {"budgets": {"gpu": gpu, "host": int(args.host_fraction * 16 * n), "nvme": "1TiB"},
               "nvme": {"dirs": [args.swap_dir]}}
    else:  # as ZeRO-Offload: params and gradients on the device, the optimizer states on the host
        gpu += 8 * n
        cfg = {"budgets": {"gpu": gpu, "host": 24 * n + (64 << 20)}}
    cfg.update(device={"kind": "sim", "budget": gpu + (64 << 20)}, threads=args.threads)
    model = st.wrap(model, cfg)
    opt = st.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    return model, opt, cfg


def worker(args):
    """Trains one engine; prints RESULT <json>."""
    import torch.nn.functional as F
    from torch_gpt import batches, corpus
    torch.set_num_threads(args.threads)
    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    if args.worker == "deepspeed":
        engine, cfg, extra = deepspeed_engine(args, model)
        forward = engine

        def backward_and_step(loss):
            engine.backward(loss)
            engine.step()
    elif args.worker == "torch":  # the reference: torch alone, everything in memory
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, foreach=False)
        forward, cfg, extra = model, {}, {}

        def backward_and_step(loss):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        model, opt, cfg = strata_engine(args, model)
        forward, extra = model, {}

        def backward_and_step(loss):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    init_s = time.perf_counter() - t0
    it = batches(corpus(fixed=True), args.batch, args.seq, seed=1)
    losses, times, io0 = [], [], None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            io0 = proc_io()
        x, y = next(it)
        t = time.perf_counter()
        logits = forward(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        backward_and_step(loss)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    io1 = proc_io()
    if args.worker == "strata":
        layout = model.strata.engine.layout()
        extra = {k: layout[k] for k in ("plan_gpu_bytes", "plan_host_bytes", "plan_nvme_bytes", "families")}
    timed = times[args.warmup:]
    print("RESULT " + json.dumps(dict(
        extra, engine=args.worker, params=params, config=cfg, init_s=round(init_s, 3),
        step_times_s=[round(t, 4) for t in times], step_s=statistics.median(timed), losses=losses,
        disk_read_bytes_per_step=(io1[0] - io0[0]) // args.steps,
        disk_write_bytes_per_step=(io1[1] - io0[1]) // args.steps, peak_rss_bytes=peak_rss())), flush=True)


# ---- the parent: disk, rounds, figures -------------------------------------------------------

def remove_stale(root):
    """Removes strata-zi-<pid>-* directories under root whose process is gone (a run killed with SIGKILL)."""
    for d in glob.glob(os.path.join(root, "strata-zi-*")):
        try:
            pid = int(os.path.basename(d).split("-")[2])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(d, ignore_errors=True)


def run_one(engine, args, swap_root):
    swap = tempfile.mkdtemp(prefix=f"{engine}-", dir=swap_root)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", engine, "--swap-dir", swap]
    for k in ("peer", "d", "layers", "seq", "batch", "warmup", "steps", "threads", "lr", "host_fraction"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    try:
        # The worker dies with this process (PR_SET_PDEATHSIG), so a killed bench leaves no trainer running.
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, preexec_fn=die_with_parent)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "ok": False, "why": f"did not finish within --timeout {args.timeout} s"}
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        tail = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()][-12:]
        return {"engine": engine, "ok": False, "why": f"exit {p.returncode}", "output_tail": tail}
    return dict(json.loads(line[-1][len("RESULT "):]), ok=True)


def die_with_parent():
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def quartiles(v):
    q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
    return {"median": statistics.median(v), "q1": q[0], "q3": q[2], "min": min(v), "max": max(v)}


def summary(runs):
    per = {e: [r for r in runs if r["engine"] == e] for e in ("deepspeed", "strata", "torch")}
    reference = per["torch"][0]
    out = {"torch": {"step_s": [round(r["step_s"], 4) for r in per["torch"]], "losses": reference["losses"],
                     "peak_rss_bytes": max(r["peak_rss_bytes"] for r in per["torch"])}}
    for e, rs in ((e, per[e]) for e in ("deepspeed", "strata")):
        out[e] = {"step_s": [round(r["step_s"], 4) for r in rs],
                  "init_s": [r["init_s"] for r in rs],
                  "disk_read_bytes_per_step": statistics.median(r["disk_read_bytes_per_step"] for r in rs),
                  "disk_write_bytes_per_step": statistics.median(r["disk_write_bytes_per_step"] for r in rs),
                  "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs), "losses": rs[0]["losses"],
                  "params": rs[0]["params"], "config": rs[0]["config"],
                  # Against torch alone on the same weights and batches: the optimizers' rounding only, when
                  # the engine does the same work.
                  "loss_max_rel_diff_vs_torch": max(abs(a - b) / abs(b) for a, b in
                                                    zip(rs[0]["losses"], reference["losses"])),
                  "over_torch": statistics.median(r["step_s"] / t["step_s"] for r, t in zip(rs, per["torch"]))}
        out[e].update({k: rs[0][k] for k in ("optimizer", "plan_gpu_bytes", "plan_host_bytes", "plan_nvme_bytes",
                                             "families") if k in rs[0]})
    ratios = [s["step_s"] / d["step_s"] for d, s in zip(per["deepspeed"], per["strata"])]
    out["strata_over_deepspeed"] = quartiles(ratios)
    out["round_ratios"] = [round(r, 4) for r in ratios]
    return out


def main(args):
    if args.worker:
        worker(args)
        return 0
    ok, ops = deepspeed_ops()
    if args.build_ops:
        print(json.dumps(ops))
        return 0 if ok else 1
    if not ok:
        print(f"zero_infinity.py: SKIP: {ops['why']}. Fix: {ops['fix']}", file=sys.stderr)
        return SKIP
    root = os.path.abspath(args.nvme_dir or tempfile.gettempdir())
    remove_stale(root)
    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    del model
    need = 2 * 16 * params + (1 << 30)
    free = shutil.disk_usage(root).free
    if free < need:
        print(f"zero_infinity.py: {root} has {free / 2**30:.1f} GiB free; the runs need {need / 2**30:.1f} GiB "
              "(2 x 16 B a parameter and 1 GiB of margin). Choose --nvme-dir elsewhere or a smaller --d/--layers",
              file=sys.stderr)
        return 1
    out = {"convention": CONVENTION, "peer": {"infinity": "ZeRO-Infinity", "offload": "ZeRO-Offload"}[args.peer],
           "torch_version": torch.__version__, "deepspeed_ops": ops,
           "model": {"d": args.d, "layers": args.layers, "seq": args.seq, "batch": args.batch, "params": params},
           "warmup": args.warmup, "steps": args.steps, "threads": args.threads, "nvme_dir": root,
           "load_before": os.getloadavg()}
    swap_root = tempfile.mkdtemp(prefix=f"strata-zi-{os.getpid()}-", dir=root)
    runs = []
    try:
        order = ("deepspeed", "strata", "torch")
        for i in range(args.rounds):
            for engine in order[i % 3:] + order[:i % 3]:
                runs.append(run_one(engine, args, swap_root))
                r = runs[-1]
                print(f"zero_infinity: {engine}: " + (f"median step {r['step_s']:.3f} s" if r["ok"] else r["why"]),
                      file=sys.stderr, flush=True)
                if not r["ok"]:
                    break
            if not runs[-1]["ok"]:
                break
    finally:
        shutil.rmtree(swap_root, ignore_errors=True)
    out["load_after"] = os.getloadavg()
    failed = [r for r in runs if not r["ok"]]
    if failed:
        out["failed"] = failed
    else:
        out.update(summary(runs))
    if args.json:
        print(json.dumps(out, indent=1))
    elif not failed:
        r = out["strata_over_deepspeed"]
        print(f"{CONVENTION}\n{params / 1e6:.1f} M params: ratio {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}); "
              f"strata {statistics.median(out['strata']['step_s']):.3f} s, "
              f"{out['peer']} {statistics.median(out['deepspeed']['step_s']):.3f} s; "
              f"torch alone {statistics.median(out['torch']['step_s']):.3f} s; losses against torch's: strata "
              f"{out['strata']['loss_max_rel_diff_vs_torch']:.2e}, "
              f"{out['peer']} {out['deepspeed']['loss_max_rel_diff_vs_torch']:.2e} (relative)")
    if failed:
        print(f"zero_infinity.py: FAILED: {failed[0]['engine']}: {failed[0]['why']}\n  "
              + "\n  ".join(failed[0].get("output_tail", [])), file=sys.stderr)
        return 1
    # strata must train what torch alone trains; DeepSpeed's difference is reported, not checked (a peer's).
    if args.check and out["strata"]["loss_max_rel_diff_vs_torch"] > args.loss_rtol:
        print(f"zero_infinity.py: FAILED: strata's losses differ from torch's by "
              f"{out['strata']['loss_max_rel_diff_vs_torch']:.2e} (relative), beyond --loss-rtol {args.loss_rtol}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
