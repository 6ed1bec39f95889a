import sys

from tf_dataset.native import main

sys.exit(main())
