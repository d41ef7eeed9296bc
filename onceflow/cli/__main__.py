"""`python -m onceflow.cli`: the `onceflow` command. Main thread."""

import sys

from onceflow.cli.main import main

sys.exit(main())
