import sys

from mtp_train.cli import main

sys.exit(main())
