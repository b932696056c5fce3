"""`python -m dspark.cli ...` is the same as the `dspark` console script."""

import sys

from dspark.cli.main import main

sys.exit(main())
