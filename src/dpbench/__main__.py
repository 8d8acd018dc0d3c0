import sys

from dpbench.cli import main

sys.exit(main())
