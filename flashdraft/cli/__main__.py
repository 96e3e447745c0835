"""`python -m flashdraft.cli …` (and `torchrun … -m flashdraft.cli train …`)."""

import sys

from . import main

sys.exit(main())
