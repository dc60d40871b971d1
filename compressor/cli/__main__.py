"""`python -m compressor.cli` (torchrun's form of `compress`)."""

import sys

from compressor.cli import main

sys.exit(main())
