"""`python -m components.verify --endpoint URL --model NAME`: the operator's one-line check (exit 0 verified)."""

import sys

from components.verify.verifier import main

sys.exit(main())
