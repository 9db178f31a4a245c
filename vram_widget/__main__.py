"""``python -m vram_widget``: the ``vram-widget`` command line
(:mod:`vram_widget._display.cli`)."""

from ._display.cli import main

raise SystemExit(main())
