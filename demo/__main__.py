"""`python -m demo` (what `make demo` runs)."""

from demo.replay import main

raise SystemExit(main())
