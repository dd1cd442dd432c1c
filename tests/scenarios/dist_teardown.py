"""Ranks that abort as they exit, after their work: for tests/runners/test_rank_teardown.py, which
holds ``support.distributed`` to running such a job once more, and only such a job."""

import json
import os
import sys
import time


def worker(rank: int, world: int, port: int, out_dir: str, cases: list[str]) -> None:
    (case,) = cases
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as stream:
        json.dump({"rank": rank}, stream)
    marker = os.path.join(out_dir, "aborted")
    if rank == 0 and (case == "always" or (case == "once" and not os.path.exists(marker))):
        # As at a real teardown: every rank has written its results (run_cases waits for them).
        deadline = time.monotonic() + 30
        while not all(os.path.exists(os.path.join(out_dir, f"rank{other}.json")) for other in range(world)) and time.monotonic() < deadline:
            time.sleep(0.05)
        open(marker, "w").close()
        sys.stderr.write("terminate called without an active exception\n")
        sys.stderr.flush()
        os.abort()  # SIGABRT, as a C++ teardown's std::terminate


if __name__ == "__main__":  # a job of one process: python dist_teardown.py OUT_DIR CASE
    worker(0, 1, 0, sys.argv[1], [sys.argv[2]])
    if sys.argv[2] == "fails":
        sys.exit("a plain failure, not a teardown abort")
