import sys

from rtrl_serving.capture.cli import main

sys.exit(main())
