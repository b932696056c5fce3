"""`python -m dspark_cli ...` is the same as the `dspark` console script."""

import sys

from dspark_cli.main import main

sys.exit(main())
