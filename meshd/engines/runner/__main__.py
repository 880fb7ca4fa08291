"""``python -m meshd.engines.runner``: a runner process (see :mod:`.process`)."""

from .process import main

raise SystemExit(main())
