import sys

from fastddpm.cli import main

sys.exit(main())
