"""``python -m crf_replaysim`` runs the ``crf-replaysim`` command line."""

from crf_replaysim.cli import main

raise SystemExit(main())
