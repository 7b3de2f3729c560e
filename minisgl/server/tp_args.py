"""The command line of chapter 21: how many ranks, over how many machines, where they meet.

Every machine runs the same command with its own `--node-rank`. What can be checked
before anything starts is checked here, so that a wrong count is a usage error rather
than a rank that dies after loading.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minisgl.server.args import ConfigParser


def add_tp_options(p: ConfigParser) -> None:
    p.config_option("tp_size", type=int, help="ranks (GPUs) the model is cut over")
    p.config_option("nnodes", type=int, help="machines the --tp-size ranks span")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's place, from 0")
    p.config_option("dist_init_addr", help="host:port of node 0 for the ranks")


def check_tp_options(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if not 0 <= a.node_rank < a.nnodes:
        p.error(f"--node-rank {a.node_rank} is not in [0, --nnodes {a.nnodes})")
    if a.nnodes > 1 and a.dist_init_addr is None:
        p.error("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, on every node)")
    if a.tp_size == 1:
        return
    # Imported here: they import torch, which one rank and the API server's process do without.
    from minisgl.layers.parallel import check_tp
    from minisgl.models.config import ModelConfig

    try:
        check_tp(ModelConfig.from_path(a.model), a.tp_size)
    except ValueError as e:
        p.error(f"--tp-size: {e}")
