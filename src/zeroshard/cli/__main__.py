"""`python -m zeroshard.cli`: the same as the `zeroshard` command."""

import sys

from . import main

sys.exit(main())
