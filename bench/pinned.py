"""Exec a command pinned to a CPU set, with the open-file limit raised to its hard limit.

    python bench/pinned.py CPUS COMMAND [ARGS...]      # CPUS: "0", "1", "0,1" or "all"

No `--` handling on purpose: everything after CPUS is the command line, verbatim.
"""

from __future__ import annotations

import os
import resource
import sys


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    cpus = sys.argv[1]
    if cpus != "all":
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    os.execvp(sys.argv[2], sys.argv[2:])


if __name__ == "__main__":
    main()
