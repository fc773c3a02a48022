"""A replica process of `radixrt serve --dp` (`python -m radixrt.server.replica INDEX
LOG_LEVEL`, its pickled ServeConfig on stdin): serve() until SIGTERM."""

from __future__ import annotations

import logging
import os
import pickle
import sys

from radixrt.server.launch import serve


def main() -> None:
    index, log_level = int(sys.argv[1]), sys.argv[2]
    cfg = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s replica{index} %(levelname)s %(message)s"
    )
    code = serve(cfg)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
