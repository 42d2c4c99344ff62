import sys

from halfmoon.cli import main

sys.exit(main())
