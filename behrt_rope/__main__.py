"""``python -m behrt_rope`` is the same as the ``behrt-rope`` console script."""

from behrt_rope.cli import main

raise SystemExit(main())
