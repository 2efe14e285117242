import sys

from autoloader._cli import main

sys.exit(main())
