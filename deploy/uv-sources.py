"""Print `uv pip install` flags that read the packages from where this machine's pip reads them.

uv does not read pip's configuration (pip.conf files, PIP_* variables); `make install` runs uv, so
it hands uv the same find-links, index URLs and constraints through this script, which asks pip
itself (`pip config list`). pip takes the best version across all its indexes; uv's default takes
the first index that has a package, so the script asks uv for pip's rule (unsafe-best-match).
Usage: python deploy/uv-sources.py   (run by the venv's python, whose pip is the one the Makefile ran)
"""

import ast
import subprocess
import sys

FLAGS = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "constraint": "--constraint"}

listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True).stdout
flags = ["--index-strategy", "unsafe-best-match"]
for line in listing.splitlines():
    key, _, value = line.partition("=")
    flag = FLAGS.get(key.rpartition(".")[2])
    for item in ast.literal_eval(value).split() if flag else []:
        if item not in flags:
            flags += [flag, item]
print(" ".join(flags))
