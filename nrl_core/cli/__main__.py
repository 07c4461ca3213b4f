import sys

from nrl_core.cli import main

sys.exit(main())
