import sys

from baton.cli import main

sys.exit(main())
