"""strata's communicator over torch.distributed (issue #48; Note [Comm over torch.distributed]
in python/src/torch_comm.cpp): 2 and 4 processes on gloo with a file:// rendezvous, each
running comm_worker.py. The collectives are exact (rank-ordered sums bit for bit), and a
dead peer is an error within the timeout, never a hang. Nothing is left on disk."""

import os
import sys
import tempfile
import time

import pytest

from procs import run_all

WORKER = os.path.join(os.path.dirname(__file__), "comm_worker.py")


def run_group(world, mode, seed=48):
    """Runs `world` ranks; returns each rank's (returncode, output). The rendezvous file
    lives in a temporary directory that must be empty once the ranks are gone."""
    with tempfile.TemporaryDirectory(prefix="strata-comm-") as tmp:
        store = os.path.join(tmp, "store")
        env = dict(os.environ, STRATA_LOG_LEVEL="error")
        results = run_all([[sys.executable, WORKER, str(r), str(world), store, str(seed), mode] for r in range(world)],
                          env, 50)
        # FileStore removes its file once every rank is done with it; a rank that died
        # (dead-peer) leaves it, which the directory's removal takes care of.
        leftovers = os.listdir(tmp) if mode == "exact" else []
    assert not os.path.exists(tmp)
    assert leftovers == [], f"files left behind: {leftovers}"
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_are_exact(world):
    for rank, (rc, out) in enumerate(run_group(world, "exact")):
        assert rc == 0 and out.rstrip().endswith("ok"), f"rank {rank} (exit {rc}):\n{out}"


@pytest.mark.parametrize("mode", ["dead-peer", "hung-peer"])
def test_dead_peer_is_an_error_within_the_timeout_not_a_hang(mode):
    t0 = time.monotonic()
    results = run_group(3, mode)
    assert time.monotonic() - t0 < 45
    for rank, (rc, out) in enumerate(results[:-1]):
        assert rc == 0 and "dead peer reported" in out and out.rstrip().endswith("ok"), f"rank {rank}:\n{out}"
    assert results[-1][0] == 0, results[-1][1]
