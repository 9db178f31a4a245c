"""``python -m vram_widget``: the ``vram-widget`` command line (see :mod:`vram_widget._cli`)."""

from ._cli import main

raise SystemExit(main())
