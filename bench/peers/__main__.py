import sys

from bench.peers.harness import main

sys.exit(main())
