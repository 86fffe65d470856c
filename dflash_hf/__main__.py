"""``python -m dflash_hf``: the same as the ``dflash-hf`` command."""

import sys

from .cli import main

sys.exit(main())
