"""The package builds without setuptools warnings and ships the bundled tiny model and task."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def test_build_py_has_no_warnings_and_ships_the_assets(tmp_path):
    # build_py is the step of `pip install` that checks `packages` against the folders it copies.
    code = "import setuptools; setuptools.setup()"
    done = subprocess.run([sys.executable, "-W", "error", "-c", code, "-q", "egg_info", "--egg-base", str(tmp_path),
                           "build_py", "--build-lib", str(tmp_path / "lib")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "absent from the `packages`" not in output and "Warning" not in output, output
    lib = tmp_path / "lib" / "lora_sweep"
    for path in ("assets/tiny-llama/model.safetensors", "assets/tiny-task/train.jsonl", "kernels/__init__.py",
                 "integrations/ray_tune.py", "cli.py"):
        assert (lib / path).is_file(), path


def test_license_is_an_spdx_expression_without_a_classifier():
    # setuptools >= 77 reads `license` as an SPDX expression and warns about License classifiers.
    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, "setup.cfg"))
    assert setup["metadata"]["license"] == "Apache-2.0"
    assert "License ::" not in setup["metadata"].get("classifiers", "")
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert '"setuptools>=77"' in f.read()
