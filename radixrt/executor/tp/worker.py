"""A tensor-parallel worker process (rank >= 1): receive each step plan from rank 0 and run
it on this rank's shard, until rank 0 says STOP or goes away.

Started by `WorkerSet` as `python -c ... FD`; FD is its end of a socket pair with rank 0
(arguments in, "hello" / traceback out). A thread blocks on that pair: end-of-file means rank
0 is gone, and the worker exits at once (no orphans, even if rank 0 was SIGKILLed). SIGINT is
ignored (Ctrl-C reaches the whole process group; rank 0 decides); SIGTERM ends the process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import traceback
from multiprocessing.connection import Connection

from radixrt.executor.tp.workers import WorkerArgs

logger = logging.getLogger(__name__)

EXIT_PARENT_GONE = 3


def main(fd: int) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    args: WorkerArgs = conn.recv()
    logging.basicConfig(
        level=args.log_level, format=f"%(asctime)s tp-rank{args.rank} %(levelname)s %(message)s"
    )
    threading.Thread(target=_exit_with_parent, args=(conn,), daemon=True).start()
    code = 0
    try:
        run(args, conn)
    except BaseException:
        message = traceback.format_exc()
        logger.error("worker failed:\n%s", message)
        with contextlib.suppress(OSError):  # rank 0 is gone: exiting is all that is left
            conn.send(("error", message))
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(args: WorkerArgs, conn: Connection) -> None:
    from radixrt.model.tp.group import TPGroup, connect_store, set_nccl_env

    set_nccl_env()
    import torch

    from radixrt.executor.runner import ModelRunner
    from radixrt.executor.tp.plan_codec import ControlKind, PlanDecoder
    from radixrt.executor.tp.runner import PLAN_CAPACITY

    device = torch.device(args.cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(args.cpu_threads)
    store = connect_store(args.store_port, args.size)
    conn.send(("hello", os.getpid()))
    group = TPGroup(args.rank, args.size, device, store)
    runner = ModelRunner(args.cfg, args.model_config, args.max_model_len, args.num_slots, tp=group)
    decoder = PlanDecoder()
    logger.info("ready")
    while True:
        kind, plan = decoder.decode(group.broadcast_bytes(None, PLAN_CAPACITY))
        if kind == ControlKind.STOP:
            break
        if kind == ControlKind.COMPARE_LAST_TOKENS:
            group.gather_host(runner.last_tokens.cpu())
            continue
        assert plan is not None
        runner.execute(plan)
    group.close()


def _exit_with_parent(conn: Connection) -> None:
    """Block on the pair; rank 0 never writes after the arguments, so EOF = it is gone."""
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    os._exit(EXIT_PARENT_GONE)
