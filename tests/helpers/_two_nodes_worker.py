"""One rank of the two-node job (``tests.helpers.nodes``), started by torchrun on an emulated node.

``python _two_nodes_worker.py OUT_DIR``: joins the gloo group once, then runs each worker module of
``WORKERS`` in turn, ``run(OUT_DIR/<name>)``; each catches its own failures and writes them for its test.
"""

from __future__ import annotations

import importlib
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import end_rank

# folder name -> the module whose ``run(folder)`` checks this rank, in the order they run
WORKERS = {
    "node_groups": "tests.comm._multinode_worker",
    "zeropp": "tests.stages.stage3._zeropp_nodes_worker",
}


def main(out: str) -> None:
    torch.set_num_threads(1)
    # A rank waits this long for a peer: 4 ranks on 2 cores shared with other work fell 60 s behind once.
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    for name, module in WORKERS.items():
        folder = Path(out, name)
        folder.mkdir(exist_ok=True)
        importlib.import_module(module).run(str(folder))
        dist.barrier()
    dist.destroy_process_group()
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1])
