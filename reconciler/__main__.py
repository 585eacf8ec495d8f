import sys

from reconciler.cli import main

sys.exit(main())
