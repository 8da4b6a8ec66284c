"""`python -m kvshm.operator`: the kvshm-operator console script."""

import sys

from kvshm.operator.main import main

sys.exit(main())
