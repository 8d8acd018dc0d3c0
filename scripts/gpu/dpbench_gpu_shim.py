"""Test scaffolding for scripts/gpu/run.sh only: lets dpbench accept a GENERATED CIFAR-10 tarball.

The GPU machine cannot reach the CIFAR-10 archive, so part2 trains a Setup 3 P1 cell on a
tarball in the official format with random images (scripts/gpu/make_cifar.py). dpbench verifies
every dataset file against the official MD5; when DPBENCH_TEST_CIFAR10_MD5 is set (run.sh sets it
to the generated file's MD5), this module, imported at interpreter start through a .pth file
that run.sh writes into a throwaway interpreter, replaces the expected CIFAR-10 checksum as soon as
dpbench.data.image_datasets is imported. Without the variable it does nothing. Never installed by dpbench.
"""

import importlib.abc
import importlib.util
import os
import sys

_MD5 = os.environ.get("DPBENCH_TEST_CIFAR10_MD5")


class _PatchCifarChecksum(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "dpbench.data.image_datasets":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.CIFAR10_MD5["cifar-10-python.tar.gz"] = _MD5
            print(f"[gpu-shim] accepting the generated CIFAR-10 tarball md5:{_MD5}", file=sys.stderr)

        spec.loader.exec_module = exec_module
        return spec


if _MD5:
    sys.meta_path.insert(0, _PatchCifarChecksum())
