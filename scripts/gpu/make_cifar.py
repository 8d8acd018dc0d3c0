"""Writes DIR/cifar10/cifar-10-python.tar.gz in the official format (the test suite's
generator, tests/data/test_data.py) with random images and prints its MD5. Test data for
scripts/gpu/run.sh, where the real archive is unreachable.

Usage: python scripts/gpu/make_cifar.py DIR [--per-batch 10000]
"""

import argparse
import hashlib
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the test suite's generator, imported by its file (tests/ is not a package)
_spec = importlib.util.spec_from_file_location("test_data", REPO / "tests" / "data" / "test_data.py")
test_data = sys.modules["test_data"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(test_data)
cifar_batches, cifar_tar = test_data.cifar_batches, test_data.cifar_tar

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("dir")
parser.add_argument("--per-batch", type=int, default=10_000, help="images per batch file (official: 10,000)")
args = parser.parse_args()
target = Path(args.dir) / "cifar10" / "cifar-10-python.tar.gz"
target.parent.mkdir(parents=True, exist_ok=True)
blob = cifar_tar(cifar_batches(per_batch=args.per_batch), compresslevel=1)  # random pixels do not compress
target.write_bytes(blob)
print(hashlib.md5(blob).hexdigest())
