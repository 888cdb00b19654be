import sys

from edgetp.cli import main

sys.exit(main())
