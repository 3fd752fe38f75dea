"""Helpers of the tests that compile Triton kernels for a GPU that is not here
(`test_gluon_compile.py`, `test_kernels_compile.py`): the compiler runs in a process of its
own, and cuobjdump reports what it made.

A process of its own, because the interpreter, which other tests run in theirs, leaves
Triton's language patched for interpreted kernels; with a fresh cache, because a cached
kernel would hide what the installed Triton now makes of the source.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def compile_in_fresh_process(script: str, *args: str, timeout: int = 900):
    """Run `script` (a test module's compiling `__main__`) without the interpreter and with an
    empty Triton cache; return the JSON of the last line it prints."""
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        run = subprocess.run([sys.executable, script, *args], env=dict(env, TRITON_CACHE_DIR=cache),
                             capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def resource_usage(compiled) -> dict:
    """SHARED (bytes, as launched), REG, STACK, LOCAL, ... of a compiled kernel: cuobjdump's
    (shipped with Triton) report on its cubin."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", path], capture_output=True,
                             text=True, check=True).stdout
    fields = [f for line in out.splitlines() if "REG:" in line for f in line.split()]
    usage = {k: v for k, v in (f.split(":", 1) for f in fields if ":" in f)}
    return dict(usage, SHARED=compiled.metadata.shared)
