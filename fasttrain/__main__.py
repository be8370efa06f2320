"""``python -m fasttrain`` runs the command-line interface."""

from fasttrain.cli import main

raise SystemExit(main())
