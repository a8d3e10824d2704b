"""One rank of test_torch_comm.py: strata's communicator over torch.distributed (gloo).

    comm_worker.py RANK WORLD STORE_FILE SEED exact|dead-peer|hung-peer

exact: every collective of strata.torch._C.TorchComm against a reference formed here
from every rank's inputs (each rank makes all of them from the seed): reduce_scatter
(fp32, bf16, in place) equals the rank-ordered sum bit for bit, all_gather (in place
too) and broadcast are exact, the fp64 all_reduce sum is the rank-ordered sum, max the max.
dead-peer: the last rank exits without calling; every other rank's all_reduce must
fail within the timeout naming the op and its rank, and the next call too.
hung-peer: the same with a last rank that lives but does not call: the timeout ends the wait.
Prints "ok" and exits 0 on success; any failure is an exception (exit 1).
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from strata.torch import _C

COUNT = 1003  # elements per rank's slice: not a multiple of any vector width


def inputs(seed, rank, world, dtype):
    """Rank `rank`'s send buffer: W slices of values over six orders of magnitude, so
    that the order of the additions shows in the rounding."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randn(world * COUNT, generator=g, dtype=torch.float64)
    scale = 10.0 ** torch.randint(-3, 4, (world * COUNT,), generator=g).to(torch.float64)
    return (x * scale).to(dtype)


def rank_ordered_sum(parts):
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = acc + p  # rounds to the dtype after each addition, as sum_in_rank_order
    return acc


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def check_reduce_scatter(comm, seed, rank, world, dtype, in_place):
    sends = [inputs(seed, r, world, dtype) for r in range(world)]
    mine = slice(rank * COUNT, (rank + 1) * COUNT)
    expect = rank_ordered_sum([s[mine] for s in sends])
    send = sends[rank].clone()
    recv = send[mine] if in_place else torch.empty(COUNT, dtype=dtype)
    comm.reduce_scatter(send, recv)
    assert torch.equal(bits(recv), bits(expect)), f"reduce_scatter {dtype} in_place={in_place}: not bit-exact"
    if world >= 3:  # the check can tell: another order rounds differently
        other = rank_ordered_sum([s[mine] for s in reversed(sends)])
        assert not torch.equal(bits(other), bits(expect)), "inputs too tame to tell a summation order"


def check_exact(comm, seed, rank, world):
    assert (comm.rank, comm.size, comm.backend) == (rank, world, "torch")
    for bad in (lambda: comm.reduce_scatter(torch.zeros(world, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)),
                lambda: comm.all_gather(torch.zeros(2), torch.zeros(2 * world + 1)),
                lambda: comm.all_reduce([1.0], "min"),
                lambda: comm.broadcast(torch.zeros(1), world)):
        try:
            bad()
        except ValueError:
            pass
        else:
            raise AssertionError("a bad argument was accepted")
    for dtype in (torch.float32, torch.bfloat16):
        check_reduce_scatter(comm, seed, rank, world, dtype, in_place=False)
    check_reduce_scatter(comm, seed, rank, world, torch.float32, in_place=True)

    for dtype in (torch.float32, torch.bfloat16):
        slices = [inputs(seed + 1, r, world, dtype)[:COUNT] for r in range(world)]
        recv = torch.empty(world * COUNT, dtype=dtype)
        comm.all_gather(slices[rank], recv)
        assert torch.equal(bits(recv), bits(torch.cat(slices))), f"all_gather {dtype}: not exact"
    recv = torch.zeros(world * COUNT)  # in place: send is recv's own slice
    recv[rank * COUNT:(rank + 1) * COUNT] = slices_f32 = inputs(seed + 4, rank, world, torch.float32)[:COUNT]
    comm.all_gather(recv[rank * COUNT:(rank + 1) * COUNT], recv)
    expect = torch.cat([inputs(seed + 4, r, world, torch.float32)[:COUNT] for r in range(world)])
    assert torch.equal(bits(recv), bits(expect)) and torch.equal(recv[rank * COUNT:(rank + 1) * COUNT], slices_f32)

    values = [inputs(seed + 2, r, world, torch.float64)[:7].tolist() for r in range(world)]
    expect_sum = []
    for i in range(7):
        acc = values[0][i]
        for v in values[1:]:
            acc += v[i]  # rank order, in fp64
        expect_sum.append(acc)
    assert comm.all_reduce(values[rank], "sum") == expect_sum, "all_reduce sum: not the rank-ordered sum"
    assert comm.all_reduce(values[rank], "max") == [max(v[i] for v in values) for i in range(7)]

    root = world - 1
    g = torch.Generator().manual_seed(seed + 3)
    payload = torch.randint(0, 256, (4099,), generator=g, dtype=torch.uint8)
    data = payload.clone() if rank == root else torch.zeros(4099, dtype=torch.uint8)
    comm.broadcast(data, root)
    assert torch.equal(data, payload), "broadcast: not exact"

    # Count 0: nothing moves, every rank agrees.
    comm.reduce_scatter(torch.empty(0), torch.empty(0))
    comm.all_gather(torch.empty(0), torch.empty(0))
    assert comm.all_reduce([], "sum") == []

    s = comm.stats()
    peers = world - 1
    assert s["reduce_scatter_bytes"] == (COUNT * 4 + COUNT * 2 + COUNT * 4) * peers, s
    assert s["all_gather_bytes"] == (COUNT * 4 + COUNT * 2 + COUNT * 4) * peers, s
    assert s["all_reduce_bytes"] == 2 * 7 * 8 * peers, s
    assert s["broadcast_bytes"] == (4099 * peers if rank == root else 0), s
    assert s["collectives"] == 3 + 3 + 2 + 1 + 3, s


def check_dead_peer(comm, rank, world, timeout_ms, hung):
    comm.broadcast(torch.zeros(1), 0)  # every rank is connected
    if rank == world - 1:
        if hung:  # alive but never calls: only the timeout can tell
            time.sleep(timeout_ms / 1000 + 4)
        os._exit(0)  # dies without calling the next collective
    t0 = time.monotonic()
    try:
        comm.all_reduce([1.0], "sum")
    except _C.StrataError as e:
        first = str(e)
    else:
        raise AssertionError("all_reduce with a dead peer returned")
    took = time.monotonic() - t0
    assert took < timeout_ms / 1000 + 3, f"the error took {took:.1f} s"
    if hung:
        assert took > timeout_ms / 1000 * 0.9, f"a hung peer reported after {took:.1f} s, before the timeout"
    assert "all_reduce" in first and f"rank {rank} of {world}" in first, first
    try:
        comm.broadcast(torch.zeros(1), 0)
    except _C.StrataError as e:
        assert str(e) == first, (str(e), first)  # broken: the first error again
    else:
        raise AssertionError("a broken communicator started a collective")
    print(f"rank {rank}: dead peer reported after {took:.1f} s: {first}")


def main():
    rank, world, store, seed, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    # gloo's own timeout bounds its worker threads after a peer died (the process then exits).
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    group = dist.distributed_c10d._get_default_group()
    timeout_ms = 3000
    try:
        _C.TorchComm(group, timeout_ms=0)
    except ValueError:
        pass
    else:
        raise AssertionError("timeout_ms=0 was accepted")
    comm = _C.TorchComm(group, timeout_ms=timeout_ms)
    if mode == "exact":
        check_exact(comm, seed, rank, world)
        del comm
        dist.destroy_process_group()  # the last rank out removes the store file
        print("ok", flush=True)
        return
    check_dead_peer(comm, rank, world, timeout_ms, hung=mode == "hung-peer")
    print("ok", flush=True)
    os._exit(0)  # without the group's teardown, which could wait on the peer that is gone


if __name__ == "__main__":
    main()
