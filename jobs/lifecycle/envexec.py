"""`python -m tokenmill.jobs.lifecycle.envexec CMD ...`: run CMD with the fast vLLM-CPU environment
(cores bound, tcmalloc and Intel OpenMP preloaded), as `tokenmill run` does for itself.
Used by `make test` and `make bench`, whose engines run inside pytest or the benchmark."""

from __future__ import annotations

import os
import sys


def main() -> None:
    from tokenmill.transforms.engines.cpu import cpu_runtime_env
    from tokenmill.transforms.engines.device import has_nvidia_gpu

    if len(sys.argv) < 2:
        sys.exit("usage: python -m tokenmill.jobs.lifecycle.envexec CMD [ARGS...]")
    env = dict(os.environ)
    if not has_nvidia_gpu():
        env.update(cpu_runtime_env())
    env["TOKENMILL_REEXECED"] = "1"
    os.execvpe(sys.argv[1], sys.argv[1:], env)


if __name__ == "__main__":
    main()
